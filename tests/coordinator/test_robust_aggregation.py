"""Robust aggregation: a finite but huge outer gradient is clipped (or refused), counted and visible on its
contribution, and the apply never commits non-finite weights."""

from __future__ import annotations

import math
from typing import Any

import torch
from fastapi.testclient import TestClient

from modules import decode
from tests.coordinator.helpers import A, create_running_run, eventually, join, lease, train_lease, upload, wait_applied

HUGE = 3.4e38
"""Finite in float32; before the bounds, one such upload left 4 of 6 modules entirely non-finite."""


def _round(client: TestClient, run: dict[str, Any], *, huge_path: int) -> list[Any]:
    """One round of the 2x2 run: every path trains; path `huge_path` uploads 3.4e38 everywhere instead."""
    replies = []
    for p in range(run["num_paths"]):
        island_id, h = join(client, f"island-{p}-{run['id']}")
        body = lease(client, island_id, h)
        assert body is not None
        grads = train_lease(client, body, h)
        if body["path_index"] == huge_path:
            grads = {k: torch.full_like(v, HUGE) for k, v in grads.items()}
        replies.append(upload(client, body, h, grads))
    return replies


def _all_finite(client: TestClient, run_id: int) -> bool:
    for m in client.get(f"/v1/modules?run_id={run_id}", headers=A).json()["data"]:
        weights = decode(client.get(f"/v1/modules/{m['id']}/weights", headers=A).content)
        if not all(bool(torch.isfinite(t).all()) for t in weights.values()):
            return False
    return True


def test_a_huge_upload_is_clipped_counted_and_shown(client: TestClient) -> None:
    run = create_running_run(client, name="clip")
    replies = _round(client, run, huge_path=3)
    assert [r.status_code for r in replies] == [200] * 4 and replies[-1].json()["round_applied"]
    wait_applied(client, run["id"])
    assert _all_finite(client, run["id"])
    modules = client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]
    assert all(m["version"] == 1 for m in modules)
    contributions = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    huge = next(c for c in contributions if c["path_index"] == 3)
    assert len(huge["modules"]) == 4  # embed, one module per routed level, head
    for part in huge["modules"]:
        assert part["norm"] > 1e38 and 0 < part["scale"] < 1e-30
        assert part["note"].startswith("clipped by ") and "over the round's bound" in part["note"]
    for c in contributions:
        if c["path_index"] != 3:
            assert all(part["scale"] == 1 and part["note"] is None and 0 < part["norm"] < 1e3 for part in c["modules"])
    clipped = 'dipaco_outer_gradient_outliers_total{action="clipped"} 4.0'
    assert clipped in eventually(lambda: client.get("/metrics").text, lambda text: clipped in text)


def test_refuse_mode_refuses_the_upload_itself_and_changes_nothing(client: TestClient) -> None:
    run = create_running_run(client, name="refuse", outer={"outliers": "refuse", "max_norm": 1e3})
    replies = _round(client, run, huge_path=3)
    refused = replies[-1] if replies[-1].status_code == 422 else next(r for r in replies if r.status_code == 422)
    detail = refused.json()["detail"]
    assert detail.startswith("outer gradient of level ") and "over the run's bound outer.max_norm = 1000" in detail
    assert sum(r.status_code == 200 for r in replies) == 3
    # nothing of the refused upload was recorded: the round waits for path 3
    contributions = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert sorted(c["path_index"] for c in contributions) == [0, 1, 2]
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0
    assert 'dipaco_contributions_total{result="invalid"} 1.0' in client.get("/metrics").text


def test_relative_bound_catches_an_outlier_under_the_absolute_one(client: TestClient) -> None:
    """The embedding and the head are shared by all 4 paths: a 100x upload is over 10 x their median."""
    run = create_running_run(client, name="relative")
    replies = []
    for p in range(run["num_paths"]):
        island_id, h = join(client, f"rel-{p}")
        body = lease(client, island_id, h)
        assert body is not None
        grads = train_lease(client, body, h)
        if body["path_index"] == 0:
            grads = {k: v * 100 for k, v in grads.items()}
        replies.append(upload(client, body, h, grads))
    assert all(r.status_code == 200 for r in replies)
    wait_applied(client, run["id"])
    contributions = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    loud = next(c for c in contributions if c["path_index"] == 0)
    levels = {m["id"]: m["level"] for m in client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]}
    shared = [part for part in loud["modules"] if levels[part["module_id"]] in (0, 3)]
    routed = [part for part in loud["modules"] if levels[part["module_id"]] in (1, 2)]
    assert all(0 < part["scale"] < 1 and part["norm"] < 1e4 for part in shared)
    assert all(part["scale"] == 1 for part in routed)  # two contributions each: no median to compare with
    assert all(math.isfinite(part["norm"]) for c in contributions for part in c["modules"])
