"""The finite check on uploaded values: NaN/Inf are counted exactly in the tensor that holds them, and finite
values whose sum overflows float32 are accepted (the check sums first and counts only when a sum is not finite)."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient

from tests.coordinator.helpers import create_running_run, join, lease, train_lease, upload


def test_non_finite_values_are_counted_in_the_tensor_that_holds_them(value_checks: str, client: TestClient) -> None:
    create_running_run(client)
    island_id, h = join(client)
    lb = lease(client, island_id, h)
    assert lb is not None
    grads = train_lease(client, lb, h)
    first, last = sorted(grads)[0], sorted(grads)[-1]
    huge = dict(grads)
    huge[first] = torch.full_like(grads[first], 3e38)  # finite, but its sum (and the payload's) overflows
    huge[last] = grads[last].clone()
    huge[last].view(-1)[:3] = float("nan")
    huge[last].view(-1)[-2:] = float("inf")
    r = upload(client, lb, h, huge)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == f"tensor {last!r} has 5 non-finite value(s) (NaN/Inf)"
    huge[last] = grads[last]
    assert upload(client, lb, h, huge).status_code == 200
