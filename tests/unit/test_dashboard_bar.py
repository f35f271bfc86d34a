"""The dashboard's budget bar: every part of available drawn apart, summing to it."""

from __future__ import annotations

from budget_tasks.dashboard.charts import bar


def kinds(row: dict[str, int]) -> dict[str, float]:
    return {s["kind"]: s["amount"] for s in bar(row)["segments"]}


def test_grants_below_and_what_the_parent_cannot_give_are_not_drawn_as_held() -> None:
    row = {"cap": 1000, "spent": 200, "held": 100, "available": 700, "granted": 150}
    row["usable"] = 400  # its parent has 400 left
    assert kinds(row) == {
        "spent": 200,
        "held": 100,
        "granted": 150,
        "available": 250,
        "blocked": 300,
    }
    parts = bar(row)["segments"]
    assert [s["kind"] for s in parts] == ["spent", "held", "granted", "available", "blocked"]
    assert sum(s["amount"] for s in parts) == row["cap"]


def test_a_budget_its_parent_stops_draws_all_of_its_available_as_blocked() -> None:
    row = {"cap": 500, "spent": 0, "held": 0, "available": 500, "granted": 0, "usable": 0}
    assert kinds(row) == {"blocked": 500}


def test_an_overrun_passes_the_cap_mark_and_draws_no_available() -> None:
    drawn = bar({"cap": 100, "spent": 130, "held": 0, "available": -30, "usable": 0})
    assert [s["kind"] for s in drawn["segments"]] == ["spent"]
    assert drawn["cap_x"] < 100
