"""Uploads that name their own sha256 (`X-Dipaco-Content-Sha256`, as the island client sends them), on a local
blob directory: a large one's values are checked on the request, its hash by the apply executor before any math
(services/staging.py); a small one is hashed on the request. The tests' bodies are small, so the `settings`
fixture here makes every upload large (`upload_stream_check_bytes` 0) except where a test says otherwise."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.settings import Settings
from modules import decode, encode
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, create_running_run, join, lease, train_lease, upload, wait_applied
from tests.coordinator.test_bad_uploads import snapshot

H_SHA = "X-Dipaco-Content-Sha256"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    settings.upload_stream_check_bytes = 0  # every upload large: named hashes are checked by the executor
    return settings


@pytest.fixture
def client(settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    with TestClient(create_app(settings, clock=clock)) as c:
        yield c


def blob_dir(settings: Settings) -> Path:
    return Path(settings.resolved_blob_url)


def staged_files(settings: Settings) -> list[str]:
    staging = blob_dir(settings) / "staging"
    return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []


def named(headers: dict[str, str], digest: str) -> dict[str, str]:
    return {**headers, H_SHA: digest}


def leased_body(client: TestClient, name: str) -> tuple[dict[str, Any], dict[str, str], bytes]:
    """A new island's lease, its headers and the upload it trained."""
    island_id, h = join(client, name)
    lb = lease(client, island_id, h)
    assert lb is not None
    return lb, h, encode(train_lease(client, lb, h))


def one_round(client: TestClient, run: dict[str, Any], *, lie_on: int | None = None) -> dict[int, bytes]:
    """Every path of round 0 uploads with its sha256 named; path `lie_on` names a sha256 its bytes do not have.
    Returns each lease's body."""
    bodies: dict[int, bytes] = {}
    for p in range(run["num_paths"]):
        lb, h, body = leased_body(client, f"island-{p}")
        digest = hashlib.sha256(body).hexdigest()
        if p == lie_on:
            digest = hashlib.sha256(body + b"other").hexdigest()
        r = upload(client, lb, named(h, digest), body)
        assert r.status_code == 200, r.text
        bodies[lb["lease_id"]] = body
    return bodies


def test_named_uploads_are_staged_then_verified_and_named_by_the_executor(
    client: TestClient, settings: Settings
) -> None:
    run = create_running_run(client, name="named", num_rounds=2)
    bodies = one_round(client, run)
    wait_applied(client, run["id"])
    # Each upload now lives under its content name, and nothing is left in the staging area.
    for body in bodies.values():
        digest = hashlib.sha256(body).hexdigest()
        assert (blob_dir(settings) / digest[:2] / digest).read_bytes() == body
    assert staged_files(settings) == []
    contributions = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert len(contributions) == run["num_paths"]
    assert all(part["scale"] == 1 and part["note"] is None for c in contributions for part in c["modules"])
    modules = client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]
    assert {m["version"] for m in modules} == {1}


def test_a_named_upload_that_lies_about_its_hash_is_refused_before_any_math(
    client: TestClient, settings: Settings
) -> None:
    # one routed level of two modules: each path has a module of its own
    run = create_running_run(client, name="liar", num_rounds=2, layout="embed:shared, b0-1:routed2, head:shared")
    modules_before = {
        m["id"]: decode(client.get(f"/v1/modules/{m['id']}/weights", headers=A).content)
        for m in client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]
    }
    bodies = one_round(client, run, lie_on=0)
    wait_applied(client, run["id"])
    contributions = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    liar = next(c for c in contributions if c["path_index"] == 0)
    assert all(part["scale"] == 0 for part in liar["modules"])
    assert all("refused at verification: the upload hashes to" in part["note"] for part in liar["modules"])
    assert all(part["scale"] == 1 for c in contributions if c is not liar for part in c["modules"])
    # Not kept under the name it claimed, nor left staged.
    claimed = hashlib.sha256(bodies[liar["lease_id"]] + b"other").hexdigest()
    assert not (blob_dir(settings) / claimed[:2] / claimed).exists()
    assert staged_files(settings) == []
    # Path 0's own module kept its weights; the shared ones moved on the other path's upload alone.
    for m in client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]:
        after = decode(client.get(f"/v1/modules/{m['id']}/weights", headers=A).content)
        only_liar = m["level"] == 1 and m["index"] == 0
        same = all(torch.equal(after[k], modules_before[m["id"]][k]) for k in after)
        assert same == only_liar, (m["level"], m["index"])


def test_a_malformed_hash_header_is_refused_and_changes_nothing(client: TestClient, settings: Settings) -> None:
    run = create_running_run(client, name="malformed")
    lb, h, body = leased_body(client, "a")
    before = snapshot(settings)
    for bad in ("abc", "A" * 64, hashlib.sha256(body).hexdigest() + "0", "g" * 64):
        r = upload(client, lb, named(h, bad), body)
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith(f"header {H_SHA} must be a lowercase hex sha256 (64 characters)")
        assert snapshot(settings) == before
    # Values are still checked on the request: a NaN is refused now, even with its hash named.
    nan = decode(body)
    name = next(iter(nan))
    nan[name].view(-1)[0] = float("nan")
    bad_body = encode(nan)
    r = upload(client, lb, named(h, hashlib.sha256(bad_body).hexdigest()), bad_body)
    assert r.status_code == 422 and r.json()["detail"] == f"tensor {name!r} has 1 non-finite value(s) (NaN/Inf)"
    assert snapshot(settings) == before and staged_files(settings) == []
    assert run["status"] == "running"


def test_a_replayed_named_upload_is_the_same_contribution(client: TestClient, settings: Settings) -> None:
    run = create_running_run(client, name="replay")
    lb, h, body = leased_body(client, "a")
    headers = named(h, hashlib.sha256(body).hexdigest())
    first = upload(client, lb, headers, body)
    again = upload(client, lb, headers, body)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["id"] == again.json()["id"]
    assert staged_files(settings) == [f"{lb['lease_id']}-{hashlib.sha256(body).hexdigest()}"]
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0


def test_a_staged_upload_survives_a_restart_before_its_round_is_applied(settings: Settings, clock: FakeClock) -> None:
    """Accepted means durable: a coordinator that stops between accepting named uploads and applying them (no
    executor in the first process) applies them after a restart, from the staging area."""
    settings.apply_workers = 0
    with TestClient(create_app(settings, clock=clock)) as first:
        run = create_running_run(first, name="restart", num_rounds=2)
        bodies = one_round(first, run)
        assert len(staged_files(settings)) == run["num_paths"]
        assert first.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0
    settings.apply_workers = 1
    with TestClient(create_app(settings, clock=clock)) as second:
        wait_applied(second, run["id"])
    assert staged_files(settings) == []
    for body in bodies.values():
        digest = hashlib.sha256(body).hexdigest()
        assert (blob_dir(settings) / digest[:2] / digest).is_file()


def test_a_small_named_upload_is_hashed_on_the_request_and_never_staged(settings: Settings, clock: FakeClock) -> None:
    """Under the threshold the body is hashed as it streams in: stored under its name when the contribution
    commits, with nothing left for the executor to verify; a body that does not hash to what it named is refused
    at once (422, an upload-refused event) and changes nothing."""
    settings.upload_stream_check_bytes = 1 << 30
    settings.apply_workers = 0  # nothing verifies or promotes: what is in the store is what the request left
    with TestClient(create_app(settings, clock=clock)) as client:
        run = create_running_run(client, name="small")
        lb, h, body = leased_body(client, "a")
        digest = hashlib.sha256(body).hexdigest()
        before = snapshot(settings)
        wrong = hashlib.sha256(body + b"other").hexdigest()
        r = upload(client, lb, named(h, wrong), body)
        assert r.status_code == 422, r.text
        assert r.json()["detail"] == f"the body hashes to {digest}, its {H_SHA} header says {wrong}"
        assert snapshot(settings) == before and staged_files(settings) == []
        events = client.get(f"/v1/events?run_id={run['id']}&kind=upload_refused", headers=A).json()["data"]
        assert [e["lease_id"] for e in events] == [lb["lease_id"]]
        r = upload(client, lb, named(h, digest), body)
        assert r.status_code == 200, r.text
        assert (blob_dir(settings) / digest[:2] / digest).read_bytes() == body
        assert staged_files(settings) == []
        contribution = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"][0]
        assert contribution["lease_id"] == lb["lease_id"]
