"""The demo exits 0 only if every claim held: one false claim makes the run fail."""

from budget_tasks.demo.checks import BudgetRow, Checks, render_table


def test_one_failed_claim_fails_the_run() -> None:
    lines: list[str] = []
    checks = Checks(lines.append)
    checks.expect("first", True)
    assert checks.ok
    checks.expect("second", False)
    checks.expect("third", True)
    assert not checks.ok
    assert lines == ["   [ok] first", "   [FAILED] second", "   [ok] third"]


def test_the_table_lines_up_every_column() -> None:
    rows = [
        BudgetRow("acme", 689, 25, 16, 9, 5, 2926, 373, 0, 0),
        BudgetRow("globex-a1", 9, 1, 1, 0, 0, 7, 5, 2, 0),
    ]
    header, *body, note1, note2 = render_table(rows).splitlines()
    assert header.split() == [
        "budget",
        "cap",
        "jobs",
        "done",
        "denied",
        "replays",
        "reserved*",
        "spent",
        "held",
        "overrun",
    ]
    assert body[1].split() == ["globex-a1", "9", "1", "1", "0", "0", "7", "5", "2", "0"]
    assert len({len(line) for line in (header, *body)}) == 1
    # the sum of every hold reads like overspend against the cap without a word
    assert note1.split()[:2] == ["*", "reserved:"] and "never passed the cap" in note2
