"""Direct uploads the apply executor cannot use are refused like a bad payload (parts at scale 0, a note saying
why), and the round goes on without them: one deleted from the bucket after its commit, one PUT again after its
commit (refused before it is downloaded), one that cannot be read claim after claim."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.blobstore import BlobError, S3BlobStore
from coordinator.client import sha256_hex
from coordinator.services.apply import ApplyExecutor
from coordinator.services.staging import REFUSED, STAGED_READ_ATTEMPTS, refusal_note
from coordinator.settings import Settings
from tests.conftest import FakeClock
from tests.coordinator.direct_helpers import app_blobs, leased_payload, request_ticket
from tests.coordinator.helpers import A, create_running_run, wait_applied

ONE_PATH = "embed:shared, b0-1:routed1, head:shared"
"""One path through every module: a refused upload is the round's only one, so no module may change."""


@pytest.fixture
def held(direct_settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    """The app on an s3:// store with no apply executor of its own: the test steps when it has tampered."""
    direct_settings.apply_workers = 0
    with TestClient(create_app(direct_settings, clock=clock)) as client:
        yield client


def _contributions(app: TestClient, run_id: int) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = app.get(f"/v1/contributions?run_id={run_id}", headers=A).json()["data"]
    return data


def _modules(app: TestClient, run_id: int) -> list[tuple[int, str]]:
    data = app.get(f"/v1/modules?run_id={run_id}", headers=A).json()["data"]
    return [(m["version"], m["weights_hash"]) for m in data]


def _executor(app: TestClient, clock: FakeClock, blobs: S3BlobStore | None = None) -> ApplyExecutor:
    state = app.app.state.dipaco  # type: ignore[attr-defined]
    return ApplyExecutor(
        sessions=state.sessions,
        blobs=blobs or state.blobs,
        clock=clock,
        name="test-0",
        claim_s=1.0,
        on_step=lambda done: state.closer.stepped(done, now=clock()),
    )


def test_a_staged_upload_deleted_after_its_commit_is_refused_and_the_round_closes(direct: TestClient) -> None:
    """Before: the executor raised on every claim of the step and the round never closed."""
    run = create_running_run(direct, name="gone", num_rounds=1)
    blobs = app_blobs(direct)
    gone: tuple[int, str] | None = None
    for p in range(run["num_paths"]):
        island, lease, payload = leased_payload(direct, f"gone-{p}")
        island.upload_direct(lease, payload, tokens=1, train_loss=1.0)
        if p == 0:  # committed, then deleted from the bucket before the round closes
            key = blobs.staging_key(f"{lease.lease_id}-{sha256_hex(payload)}")
            blobs.delete_staged(key)
            gone = lease.lease_id, key
    assert gone is not None
    assert wait_applied(direct, run["id"])["status"] == "finished"
    contributions = _contributions(direct, run["id"])
    refused = next(c for c in contributions if c["lease_id"] == gone[0])
    note = f"{REFUSED}nothing is staged at {gone[1]} (deleted from the store, or never written)"
    assert [(part["scale"], part["note"]) for part in refused["modules"]] == [(0, note)] * len(refused["modules"])
    others = [part for c in contributions if c["lease_id"] != gone[0] for part in c["modules"]]
    assert others and all(part["scale"] == 1 for part in others)
    assert {version for version, _ in _modules(direct, run["id"])} == {1}  # the other paths stepped every module


def test_an_upload_put_again_after_its_commit_is_refused_unread(held: TestClient, clock: FakeClock) -> None:
    """The ticket's URL stays good after the commit (S3 cannot revoke it), so the island can overwrite what it
    committed with a larger object: the executor asks for the committed size only (one ranged GET), sees the
    object's size in the reply and refuses it before reading a byte; nothing of it is spooled, no module moves."""
    run = create_running_run(held, name="overwritten", num_rounds=1, layout=ONE_PATH)
    before = _modules(held, run["id"])
    blobs = app_blobs(held)
    island, lease, payload = leased_payload(held, "overwriter")
    digest = sha256_hex(payload)
    ticket = request_ticket(island, lease, payload)
    assert ticket.url is not None and httpx.put(ticket.url, content=payload).status_code == 200
    commit = {"key": ticket.key, "size": len(payload), "sha256": digest, "round": 0, "tokens": 1, "train_loss": 1.0}
    r = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=commit)
    assert r.status_code == 200, r.text
    big = payload + b"\0" * (4 << 20)
    assert httpx.put(ticket.url, content=big).status_code == 200  # the same URL, after the commit: taken
    key = blobs.staging_key(f"{lease.lease_id}-{digest}")
    asked: list[dict[str, Any]] = []
    answered: list[int] = []

    def ask(params: dict[str, Any], **_: Any) -> None:
        asked.append(dict(params))

    def answer(parsed: dict[str, Any], **_: Any) -> None:
        answered.append(int(parsed.get("ContentLength", 0)))

    blobs.client.meta.events.register("provide-client-params.s3.GetObject", ask)
    blobs.client.meta.events.register("after-call.s3.GetObject", answer)
    try:
        assert _executor(held, clock).work() == 3  # embed, blocks, head
    finally:
        blobs.client.meta.events.unregister("provide-client-params.s3.GetObject", ask)
        blobs.client.meta.events.unregister("after-call.s3.GetObject", answer)
    reads = [(p.get("Range"), n) for p, n in zip(asked, answered, strict=True) if p["Key"] == key]
    assert reads == [(f"bytes=0-{len(payload) - 1}", len(payload))]  # asked for the committed bytes only
    (contribution,) = _contributions(held, run["id"])
    note = (
        f"{REFUSED}the object at {key} has {len(big)} bytes, {len(payload)} were committed "
        "(written again after its commit)"
    )
    assert [(part["scale"], part["note"]) for part in contribution["modules"]] == [(0, note)] * 3
    assert _modules(held, run["id"]) == before
    assert held.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "finished"
    assert blobs.staged_head(key, 8) is None  # removed from the staging area, as every verified upload


class _Unreadable(S3BlobStore):
    """The app's bucket, but its staged uploads cannot be read (as an object whose encryption key was revoked)."""

    reads = 0

    @staticmethod
    def error(key: str) -> str:
        return f"{key} cannot be read: AccessDenied (the object's encryption key is not usable)"

    @contextlib.contextmanager
    def open_staged(self, key: str, *, size: int) -> Iterator[tuple[Path, str]]:
        self.reads += 1
        raise BlobError(self.error(key))
        yield Path(), ""  # pragma: no cover - a generator, never reached


def test_a_staged_upload_that_cannot_be_read_is_refused_at_the_last_claim(held: TestClient, clock: FakeClock) -> None:
    """An error other than "not there" may pass (a network fault): the step fails, is given up with an
    `apply_failed` event and claimed again after its retry delay (here `claim_s`, 1 s); at its
    `STAGED_READ_ATTEMPTS`th claim the upload is refused instead and the round is applied."""
    run = create_running_run(held, name="unreadable", num_rounds=1, layout=ONE_PATH)
    before = _modules(held, run["id"])
    real = app_blobs(held)
    island, lease, payload = leased_payload(held, "unreadable")
    island.upload_direct(lease, payload, tokens=1, train_loss=1.0)
    key = real.staging_key(f"{lease.lease_id}-{sha256_hex(payload)}")
    store = _Unreadable(bucket=real.bucket, prefix=real.prefix, client=real.client)
    executor = _executor(held, clock, store)
    for attempt in range(1, STAGED_READ_ATTEMPTS):
        assert executor.work() == 0
        events = held.get(f"/v1/events?run_id={run['id']}&kind=apply_failed", headers=A).json()["data"]
        assert len(events) == 3 * attempt  # each of the 3 modules' steps reads the upload, and fails
        assert all(f"(attempt {attempt}): BlobError: " in e["detail"] for e in events[-3:])  # oldest first
        assert all("AccessDenied" in e["detail"] for e in events)
        assert executor.work() == 0  # not before its retry delay
        clock.advance(2)  # past it: the step may be claimed again
    assert executor.work() == 3
    (contribution,) = _contributions(held, run["id"])
    note = refusal_note(f"still unreadable after {STAGED_READ_ATTEMPTS} claims of its step: {_Unreadable.error(key)}")
    assert [(part["scale"], part["note"]) for part in contribution["modules"]] == [(0, note)] * 3
    # each step read it at each failed claim; the first to reach its last claim refused every part, so the
    # other steps read nothing then
    assert store.reads == 3 * (STAGED_READ_ATTEMPTS - 1) + 1
    assert _modules(held, run["id"]) == before
    assert held.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "finished"
