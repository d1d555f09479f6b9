"""The Grafana dashboard (deploy/grafana/dipaco.json) reads only metrics the coordinator exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from coordinator.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dipaco.json"


def _exported() -> set[str]:
    metrics = Metrics()
    metrics.contributions.labels(result="accepted").inc()  # labelled series appear once used
    text = generate_latest(metrics.registry).decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


def test_every_panel_queries_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    exported = _exported()
    used: set[str] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bdipaco_[a-z_]+", target["expr"]))
            assert names and names <= exported, (panel["title"], names - exported)
            used |= names
    # rounds, uploads by result, leases, bytes both ways, active islands
    assert {
        "dipaco_rounds_applied_total",
        "dipaco_contributions_total",
        "dipaco_leases_issued_total",
        "dipaco_lease_expiries_total",
        "dipaco_bytes_in_total",
        "dipaco_bytes_out_total",
        "dipaco_active_islands",
    } <= used
