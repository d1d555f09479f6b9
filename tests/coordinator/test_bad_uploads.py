"""Every bad upload gets a specific 4xx and changes nothing in the database or the blob store."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select

from coordinator.app import create_app
from coordinator.models import Contribution, ContributionGrad, Lease
from coordinator.models import Path as PathRow
from coordinator.settings import Settings
from modules import encode
from tests.conftest import JOIN, FakeClock
from tests.coordinator.helpers import create_running_run, join, lease, train_lease, upload


@pytest.fixture
def client(settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    settings.max_upload_bytes = 2_000_000
    with TestClient(create_app(settings, clock=clock)) as c:
        yield c


def snapshot(settings: Settings) -> tuple[Any, ...]:
    engine = create_engine(settings.resolved_database_url)
    try:
        with engine.connect() as conn:
            counts = tuple(conn.scalar(select(func.count()).select_from(t)) for t in (Contribution, ContributionGrad))
            leases = tuple(conn.execute(select(Lease.id, Lease.status).order_by(Lease.id)).all())
            paths = tuple(conn.execute(select(PathRow.token_offset, PathRow.tokens_trained).order_by(PathRow.id)).all())
    finally:
        engine.dispose()
    blobs = sorted(
        p.name for p in Path(settings.resolved_blob_url).rglob("*") if p.is_file() and p.parent.name != "tmp"
    )
    return counts, leases, paths, tuple(blobs)


def _reshaped_header(payload: bytes, name: str, shape: Any) -> bytes:
    """The same payload with one tensor's header `shape` replaced (tensor data untouched)."""
    (n,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + n])
    header[name]["shape"] = shape
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload[8 + n :]


def test_bad_payloads_are_refused_and_change_nothing(value_checks: str, client: TestClient, settings: Settings) -> None:
    create_running_run(client)
    island_id, h = join(client, "a")
    other_id, oh = join(client, "b")
    lb = lease(client, island_id, h)
    assert lb is not None
    good = train_lease(client, lb, h)
    name = next(iter(good))
    before = snapshot(settings)

    def renamed() -> dict[str, torch.Tensor]:
        g = dict(good)
        g["embed/not_a_param"] = g.pop(name)
        return g

    nan = dict(good)
    nan[name] = good[name].clone()
    nan[name].view(-1)[0] = float("nan")
    inf = dict(good)
    inf[name] = good[name].clone()
    inf[name].view(-1)[-1] = float("inf")
    full = encode(good)
    cases: list[tuple[str, Any, dict[str, str], int, str]] = [
        ("truncated", full[: len(full) // 2], h, 422, "outer-gradient payload: invalid safetensors payload"),
        ("garbage header", b"\x05\x00\x00\x00\x00\x00\x00\x00nope!", h, 422, "safetensors header is not valid JSON"),
        ("header too long", struct.pack("<Q", 10**9) + b"{}", h, 422, "header of 1000000000 bytes is over the"),
        ("header short", struct.pack("<Q", 100) + b"{}", h, 422, "safetensors header claims 100 bytes"),
        (
            "shape not a list",
            _reshaped_header(full, name, 3),
            h,
            422,
            f"tensor {name!r} has no valid shape",
        ),
        ("unknown tensor", renamed(), h, 422, "unknown tensor 'embed/not_a_param' in outer-gradient payload"),
        ("missing tensor", {k: v for k, v in good.items() if k != name}, h, 422, "is missing 1 tensor(s)"),
        ("wrong shape", {**good, name: good[name].flatten()[:-1]}, h, 422, f"tensor {name!r} has shape"),
        ("wrong dtype", {**good, name: good[name].double()}, h, 422, f"tensor {name!r} has dtype F64, expected F32"),
        ("nan", nan, h, 422, f"tensor {name!r} has 1 non-finite value(s) (NaN/Inf)"),
        ("inf", inf, h, 422, f"tensor {name!r} has 1 non-finite value(s) (NaN/Inf)"),
        ("oversize", b"\x00" * 2_000_001, h, 413, "over the 2000000-byte limit"),
        ("another island's lease", good, oh, 403, f"lease {lb['lease_id']} belongs to island {island_id}"),
        ("no token", good, {}, 401, "missing bearer token"),
        ("wrong token", good, {"Authorization": "Bearer island_nope"}, 401, "unknown token"),
        ("join token", good, {"Authorization": f"Bearer {JOIN}"}, 403, "needs a token of scope island, got one of"),
    ]
    for label, payload, headers, status, detail in cases:
        r = upload(client, lb, headers, payload)
        assert r.status_code == status, (label, r.status_code, r.text)
        assert detail in r.json()["detail"], (label, r.json()["detail"])
        assert snapshot(settings) == before, label
    # header problems
    for hdrs, detail in [
        ({"X-Dipaco-Round": "7"}, f"upload is for round 7, lease {lb['lease_id']} was issued for round 0"),
        ({"X-Dipaco-Tokens": "many"}, "header X-Dipaco-Tokens must be an integer, got 'many'"),
        ({"X-Dipaco-Train-Loss": "nan"}, "header X-Dipaco-Train-Loss must be finite, got 'nan'"),
    ]:
        r = client.post(
            f"/v1/leases/{lb['lease_id']}/outer-gradients",
            content=full,
            headers={**h, "X-Dipaco-Round": "0", "X-Dipaco-Tokens": "32", "X-Dipaco-Train-Loss": "5.0", **hdrs},
        )
        assert r.status_code in (409, 422) and r.json()["detail"] == detail, r.text
        assert snapshot(settings) == before
    assert other_id != island_id
    # and the good one still goes through afterwards
    assert upload(client, lb, h, good).status_code == 200
    assert snapshot(settings) != before


def test_unknown_lease_is_404(client: TestClient) -> None:
    create_running_run(client)
    _, h = join(client)
    r = client.post(
        "/v1/leases/999/outer-gradients",
        content=b"x",
        headers={**h, "X-Dipaco-Tokens": "1", "X-Dipaco-Train-Loss": "1"},
    )
    assert r.status_code == 404 and r.json()["detail"] == "lease 999 does not exist"
