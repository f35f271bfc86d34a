"""The reference app: ``celery -A workers.app worker`` (and ``beat``) from the project's
top level, settings in ``celeryconfig.py`` beside it. Copy both to start your own."""
