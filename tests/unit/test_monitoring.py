"""The Grafana dashboard and the compose ``monitoring`` profile (no Docker here): every
query names a metric budget-tasks exports, the dashboard shows what operators need,
and compose mounts the files that provision Prometheus and Grafana."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.core import Metric

from budget_tasks import Ledger
from budget_tasks.metrics import registry_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/budget-tasks.json"

#: PromQL words that are neither metrics nor labels.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "inf", "nan"}
#: what a sample of each type of family is named (prometheus_client's families drop
#: a counter's _total)
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    # label lists of aggregations and vector matching
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(\s*\()?", expr):
        word = match.group(0)
        if match.group(1) or word.lower() in KEYWORDS:
            continue  # a function call, or an operator
        if re.fullmatch(r"\d+(e\d+)?", word):
            continue
        names.add(word)
    return names


def test_the_parser_finds_metrics_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(x_bucket{budget=~"$budget", le!="+Inf"}'
        "[$__rate_interval]))) / on (budget) group_left sum without (task) (y_total) > bool 1"
    )
    assert metric_names(expr) == {"x_bucket", "y_total"}


def exported(ledger: Ledger) -> set[str]:
    """What a worker's /metrics serves: every sample name of every family."""
    names: set[str] = set()
    family: Metric
    for family in registry_for(ledger).collect():
        names.update(family.name + s for s in SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def queries(dashboard: dict[str, Any]) -> list[str]:
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append(target["expr"])
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_every_query_names_a_metric_budget_tasks_exports(
    dashboard: dict[str, Any], sqlite_ledger: Ledger
) -> None:
    sqlite_ledger.create_budget("team", 1_000_000)  # the balances have samples too
    known = exported(sqlite_ledger)
    assert {"budget_tasks_admissions_total", "budget_tasks_spent"} <= known
    exprs = queries(dashboard)
    assert len(exprs) >= 10
    read: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr  # every query reads a metric
        assert names <= known, (expr, names - known)
        read |= names
    for variable in dashboard["templating"]["list"]:
        metric, label = re.fullmatch(
            r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"]
        ).groups()  # type: ignore[union-attr]
        assert metric in known and label == "budget"
        read.add(metric)
    # what operators asked to see: spend and held against cap, admissions and denials,
    # replays, unknown outcomes, stale holds, reconciliations, actual/estimate
    wanted = {
        "budget_tasks_spent",
        "budget_tasks_held",
        "budget_tasks_cap",
        "budget_tasks_admissions_total",
        "budget_tasks_denials_total",
        "budget_tasks_replays_total",
        "budget_tasks_unknown_outcomes_total",
        "budget_tasks_stale_holds_total",
        "budget_tasks_reconciliations_total",
        "budget_tasks_actual_to_estimate_ratio_bucket",
    }
    assert wanted <= read, wanted - read


def test_every_panel_reads_the_provisioned_data_source(dashboard: dict[str, Any]) -> None:
    sources = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    [prometheus] = sources
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == prometheus["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == prometheus["uid"], panel["title"]


def _defaults(text: str) -> str:
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_the_monitoring_profile_provisions_prometheus_and_grafana() -> None:
    compose = yaml.safe_load(_defaults((ROOT / "docker-compose.yml").read_text()))
    services = compose["services"]
    for name in ("prometheus", "grafana", "flower"):
        assert services[name]["profiles"] == ["monitoring"], name
    # every file or folder compose mounts from the project exists, where it is read
    mounts: dict[str, str] = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target, *_ = volume.split(":")
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)
                mounts[target] = source
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    [provider] = yaml.safe_load((provisioning / "dashboards/budget-tasks.yml").read_text())[
        "providers"
    ]
    # Grafana loads the dashboards from the folder compose mounts them on
    dashboards = ROOT / mounts[provider["options"]["path"]]
    assert DASHBOARD.parent.resolve() == dashboards.resolve()
    [source] = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    # Prometheus scrapes the worker's metrics port
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    port = services["worker"]["environment"]["BUDGET_TASKS_METRICS_PORT"]
    assert job["static_configs"][0]["targets"] == [f"worker:{port}"]
    assert services["worker"]["environment"]["BUDGET_TASKS_METRICS_ADDR"] == "0.0.0.0"  # noqa: S104
    # Grafana has a login of the operator's, never its default one
    grafana = services["grafana"]
    # from the env file (compose reads it with none set: empty, and the check refuses)
    assert "${GF_SECURITY_ADMIN_PASSWORD:-}" in (ROOT / "docker-compose.yml").read_text()
    assert "GF_SECURITY_ADMIN_PASSWORD" in grafana["environment"]
    assert 'test -n "$$GF_SECURITY_ADMIN_PASSWORD"' in " ".join(grafana["entrypoint"])
    assert str(grafana["ports"][0]).startswith("127.0.0.1:")
