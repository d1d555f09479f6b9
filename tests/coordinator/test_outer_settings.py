"""The run's whole outer optimizer (`outer.method`, `outer.weighting`, `outer.sqrt_rescale`) reaches the apply."""

from __future__ import annotations

import math

import torch
from fastapi.testclient import TestClient

from modules import decode
from tests.coordinator.helpers import A, create_running_run, join, lease, train_lease, upload, wait_applied


def test_average_with_token_weights_makes_each_module_the_token_weighted_mean(client: TestClient) -> None:
    """`method=average`, `weighting=tokens`: a module becomes base - sum(t_i g_i) / sum(t_i) over its paths,
    with t_i the tokens each upload reported; √n scales the mean when asked for."""
    run = create_running_run(
        client, name="avg", outer={"method": "average", "weighting": "tokens", "sqrt_rescale": True}
    )
    assert run["config"]["outer"] == {
        "lr": 0.7,
        "async_lr": None,  # round levels only
        "momentum": 0.9,
        "async_momentum": None,
        "method": "average",
        "weighting": "tokens",
        "sqrt_rescale": True,
        "max_norm": 1e4,
        "max_norm_ratio": 10.0,
        "outliers": "clip",
    }
    modules = {m["id"]: m for m in client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]}
    base = {mid: decode(client.get(f"/v1/modules/{mid}/weights", headers=A).content) for mid in modules}
    uploads: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = {mid: [] for mid in modules}
    for p in range(run["num_paths"]):
        island_id, h = join(client, f"island-{p}")
        body = lease(client, island_id, h)
        assert body is not None
        grads = train_lease(client, body, h)
        tokens = 32 * (p + 1)  # unequal, so token weighting differs from the plain mean
        r = upload(client, body, h, grads, tokens=tokens)
        assert r.status_code == 200, r.text
        for m in body["modules"]:
            prefix = f"{m['level_name']}/"
            part = {k[len(prefix) :]: v for k, v in grads.items() if k.startswith(prefix)}
            uploads[m["module_id"]].append((tokens, part))
    assert r.json()["round_applied"] is True
    wait_applied(client, run["id"])
    for module in client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]:
        mid = module["id"]
        assert module["version"] == 1
        got = decode(client.get(f"/v1/modules/{mid}/weights", headers=A).content)
        parts = uploads[mid]
        total = sum(t for t, _ in parts)
        for name, start in base[mid].items():
            mean = sum(t * g[name] for t, g in parts) / total
            want = start - math.sqrt(len(parts)) * mean
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6)


def test_bad_outer_settings_are_refused_and_change_nothing(client: TestClient) -> None:
    for outer, field in (({"method": "adam"}, "method"), ({"weighting": "shards"}, "weighting")):
        r = client.post("/v1/runs", json={"name": "bad", "outer": outer}, headers=A)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", "outer", field]
    assert client.get("/v1/runs", headers=A).json()["count"] == 0
