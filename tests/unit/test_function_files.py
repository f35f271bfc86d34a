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


def test_the_functions_repeat_the_rate_windows_expressions_verbatim() -> None:
    """The rate windows' refill, give-back and narrowing, as the statements write
    them, with the functions' own names for the parameters."""
    admit, finish = functions.FUNCTIONS_DDL

    def as_in_function(expression: str) -> str:
        return (
            expression.replace("CAST(:now_ms AS BIGINT)", "r_now_ms")
            .replace("CAST(:at_ms AS BIGINT)", "s_at_ms")
            .replace("CAST(:remaining AS BIGINT)", "remaining")
            .replace("CAST(:wait_ms AS BIGINT)", "waited")
            .replace("CAST(:limit AS BIGINT)", "stated")
            .replace(":own", "took.own")
        )

    level = as_in_function(statements._RATE_LEVEL)
    assert f"SET level = {level} - want * 1000" in admit
    assert f"AND {level} >= want * 1000" in admit
    narrow = as_in_function(statements.NARROW_RATE.strip()).replace(":id", "took.window_id")
    assert " ".join(narrow.split()) in " ".join(finish.split())
    assert " ".join(as_in_function(statements.RATE_SEEN_CAP).split()) in " ".join(finish.split())
