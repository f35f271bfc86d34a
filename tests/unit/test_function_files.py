"""The server-side functions are kept as `.sql` files, read as they are written, and
repeat the statement path's shared expressions verbatim (so a change of one is a
change of both, or this fails)."""

from __future__ import annotations

import re
from importlib import resources

from budget_tasks.ledger import functions, statements


def test_each_function_is_one_file_that_makes_that_function() -> None:
    for name, ddl in zip(functions.FUNCTION_NAMES, functions.FUNCTIONS_DDL, strict=True):
        path = resources.files("budget_tasks.ledger").joinpath("sql", f"{name}.sql")
        assert ddl.strip() == path.read_text().strip()
        made = re.search(r"CREATE OR REPLACE FUNCTION (\w+)\(", ddl)
        assert made is not None and made.group(1) == name
        assert "{" not in ddl  # no template left unfilled


def test_the_functions_repeat_the_statement_paths_expressions_verbatim() -> None:
    admit, finish = functions.FUNCTIONS_DDL
    for expression in (statements.AVAILABLE, statements.GRANT_ROOM):
        assert expression in admit, expression
    assert f"ERRCODE = '{functions.NOT_HERE}'" in admit
    assert f"ERRCODE = '{functions.NOT_HERE}'" in finish
