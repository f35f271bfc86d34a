"""What the Prometheus sink counts: reservations of money, and every labelled counter
at 0 before its first event."""

from __future__ import annotations

import uuid

from prometheus_client import REGISTRY, generate_latest

from budget_tasks import metrics
from budget_tasks.hooks import DENIAL_REASONS, RECONCILE_OUTCOMES, UNTRUSTED_BY


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_a_main_attempt_of_zero_is_not_counted_as_an_admission() -> None:
    budget = f"b-{uuid.uuid4().hex[:8]}"
    metrics.SINK.admitted(budget=budget, attempt="op:0", amount=0)  # the task's main call
    metrics.SINK.admitted(budget=budget, attempt="op:openai.chat:1", amount=1)
    metrics.SINK.admitted(budget=budget, attempt="op:openai.chat:2", amount=7)
    assert sample("budget_tasks_admissions_total", budget=budget) == 2


def test_a_budgets_counters_are_made_at_zero_before_any_event() -> None:
    budget = f"b-{uuid.uuid4().hex[:8]}"
    assert sample("budget_tasks_overruns_total", budget=budget) is None
    metrics.label_budgets([budget, budget])
    for name in ("admissions", "overruns", "stale_holds"):
        assert sample(f"budget_tasks_{name}_total", budget=budget) == 0, name
    for reason in DENIAL_REASONS:
        assert sample("budget_tasks_denials_total", budget=budget, reason=reason) == 0
    for by in UNTRUSTED_BY:
        assert sample("budget_tasks_untrusted_answers_total", budget=budget, by=by) == 0
    assert sample("budget_tasks_actual_to_estimate_ratio_count", budget=budget) == 0
    for outcome in RECONCILE_OUTCOMES:
        assert sample("budget_tasks_reconciliations_total", outcome=outcome) is not None
    assert f'budget_tasks_overruns_total{{budget="{budget}"}} 0.0' in generate_latest().decode()
