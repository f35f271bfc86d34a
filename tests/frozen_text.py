"""The server-side functions' text, frozen into a migration.

A migration carries, as literal text, what it installs: it never imports the ledger's
code, which goes on changing after it. The text of ``budget_tasks_admit`` and
``budget_tasks_finish`` comes from :data:`budget_tasks.ledger.functions.FUNCTIONS_DDL`;
this module copies it into the block between :data:`BEGIN` and :data:`END` of a
migration:

    .venv/bin/python -m tests.frozen_text budget_tasks/migrations/versions/0017_partition_guards.py

Only the migration that has not landed yet is rewritten so: once it has, a change of
``functions.py`` is a new migration that installs the new text (copy the block into
it, then run this on it). ``tests/integration/test_migrations.py`` fails while the
latest migration's text differs from ``functions.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

BEGIN = "# BEGIN frozen text: budget_tasks.ledger.functions.FUNCTIONS_DDL"
END = "# END frozen text"


def literal(statements: tuple[str, ...], name: str = "FUNCTIONS_DDL") -> str:
    """``statements`` as a tuple of raw string literals assigned to ``name``."""
    for statement in statements:
        if '"""' in statement or statement.endswith("\\"):
            raise ValueError("this text needs escapes: write its literal by hand")
    body = "".join(f'    r"""{statement}""",\n' for statement in statements)
    return f"{name} = (\n{body})\n"


def rewrite(path: Path, statements: tuple[str, ...]) -> bool:
    """Replace the frozen block of migration ``path`` with ``statements``; whether
    the file changed."""
    text = path.read_text(encoding="utf-8")
    head, begin, rest = text.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END + "\n")
    if not begin or not end:
        raise ValueError(f"{path} has no block between {BEGIN!r} and {END!r}")
    new = f"{head}{BEGIN}\n{literal(statements)}{END}\n{tail}"
    if new == text:
        return False
    path.write_text(new, encoding="utf-8")
    return True


def main(argv: list[str]) -> int:
    from budget_tasks.ledger.functions import FUNCTIONS_DDL

    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    changed = rewrite(path, FUNCTIONS_DDL)
    print(f"{path}: {'rewritten' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
