"""The reference app as the wheel ships it: ``workers/`` and ``celeryconfig.py`` from the
project's top level (the files a user copies), under this package so that
``budget-tasks demo`` runs them from an installed wheel without putting a top-level
``workers`` or ``celeryconfig`` module on anyone's path. In a checkout both names are
links to those files: each task is written once."""
