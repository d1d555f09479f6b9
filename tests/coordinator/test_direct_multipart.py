"""Large direct uploads go to the bucket in parts (an S3 multipart upload) over real HTTP against moto's S3
server: the ticket hands out one pre-signed URL per part, the island PUTs them (a failed part again), the commit
carries the parts' ETags and the coordinator joins them before it reads the header. A bad parts list is refused
with a 4xx and changes nothing; a refused commit aborts the upload; the sweep aborts uploads nothing will commit.

moto enforces S3's 5 MiB minimum part size, so the parts here are real 5 MiB parts of a ~10 MiB payload (a path
of width 320); the threshold is lowered to 6 MiB (`direct_multipart_bytes`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.client import CoordinatorClient, sha256_hex
from coordinator.schemas import LeasePublic, UploadTicket
from coordinator.services.staging import sweep_staging
from coordinator.settings import Settings
from tests.conftest import FakeClock
from tests.coordinator.direct_helpers import app_blobs, island_client, leased_payload, request_ticket
from tests.coordinator.helpers import A, create_running_run, wait_applied

PART = 5 << 20
WIDE = {"flavour": "debug", "d_model": 320, "seq_len": 16, "n_heads": 4}
"""One path of this model is 2.6M parameters: a 10.06 MiB fp32 payload, three parts of 5 MiB (the last short)."""
ONE_PATH = "embed:shared, b0-1:routed1, head:shared"


@pytest.fixture
def multipart(direct_settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    direct_settings.direct_multipart_bytes = 6 << 20
    direct_settings.direct_part_bytes = PART
    with TestClient(create_app(direct_settings, clock=clock)) as client:
        yield client


def _wide_lease(
    app: TestClient, name: str, **session: Any
) -> tuple[dict[str, Any], CoordinatorClient, LeasePublic, bytes]:
    run = create_running_run(app, name=name, num_rounds=1, model=WIDE, layout=ONE_PATH)
    island, lease, payload = leased_payload(app, name, **session)
    assert lease.direct_upload
    assert 2 * PART < len(payload) < 3 * PART
    return run, island, lease, payload


def _put_parts(ticket: UploadTicket, payload: bytes) -> list[dict[str, Any]]:
    parts = []
    for part in ticket.parts:
        r = httpx.put(part.url, content=payload[part.offset : part.offset + part.size])
        assert r.status_code == 200, r.text
        parts.append({"number": part.number, "etag": r.headers["ETag"]})
    return parts


def _commit(lease: LeasePublic, ticket: UploadTicket, payload: bytes, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "key": ticket.key,
        "size": len(payload),
        "sha256": sha256_hex(payload),
        "round": lease.round,
        "tokens": 1,
        "train_loss": 1.0,
        "upload_id": ticket.upload_id,
        "parts": parts,
    }


def test_a_large_upload_goes_up_in_parts_a_failed_part_again(multipart: TestClient) -> None:
    """The bucket answers one part's first PUT with a 503 (from a MockTransport in front of moto): the client
    sends that part again, and the upload is accepted and stepped like any other."""
    real = httpx.Client()
    sent: list[tuple[str, int]] = []

    def bucket(request: httpx.Request) -> httpx.Response:
        body = request.read()
        query = parse_qs(urlsplit(str(request.url)).query)
        if request.method == "PUT":
            sent.append((query.get("partNumber", ["whole"])[0], len(body)))
            if sent[-1][0] == "2" and [n for n, _ in sent].count("2") == 1:
                return httpx.Response(503, text="<Error><Code>SlowDown</Code></Error>")
        forwarded = real.request(request.method, str(request.url), headers=request.headers, content=body)
        return httpx.Response(forwarded.status_code, headers=forwarded.headers, content=forwarded.content)

    external = httpx.Client(transport=httpx.MockTransport(bucket))
    run, island, lease, payload = _wide_lease(multipart, "parts", external=external, sleep=lambda _: None)
    contribution = island.upload_direct(lease, payload, tokens=64, train_loss=4.0)
    assert contribution.status == "accepted"
    last = len(payload) - 2 * PART
    assert sent == [("1", PART), ("2", PART), ("2", PART), ("3", last)]  # part 2 twice, no single PUT
    assert wait_applied(multipart, run["id"])["status"] == "finished"
    modules = multipart.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]
    assert [m["version"] for m in modules] == [1, 1, 1]
    (c,) = multipart.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert c["upload_bytes"] == len(payload)
    assert all(part["scale"] == 1 and part["norm"] is not None for part in c["modules"])


def test_a_ticket_is_one_put_below_the_threshold_and_parts_above_it(multipart: TestClient) -> None:
    create_running_run(multipart, name="tickets")
    island = island_client(multipart, "tickets")
    lease = island.lease()
    assert lease is not None
    small = request_ticket(island, lease, b"\0" * 1000)
    assert small.url is not None and small.upload_id is None and small.parts == []
    large = request_ticket(island, lease, b"\0" * ((6 << 20) + 3))
    assert large.url is None and large.upload_id
    assert [(p.number, p.offset, p.size) for p in large.parts] == [(1, 0, PART), (2, PART, (1 << 20) + 3)]
    assert all(f"partNumber={p.number}" in p.url and "uploadId=" in p.url for p in large.parts)


def test_a_bad_parts_list_is_refused_and_changes_nothing(multipart: TestClient) -> None:
    run, island, lease, payload = _wide_lease(multipart, "bad-parts")
    blobs = app_blobs(multipart)
    ticket = request_ticket(island, lease, payload)
    parts = _put_parts(ticket, payload)
    commit_url = f"/v1/leases/{lease.lease_id}/commit"
    # out of order: refused at the edge, the upload left as it is
    shuffled = _commit(lease, ticket, payload, [parts[0], parts[2], parts[1]])
    r = island.request("POST", commit_url, what="commit", json=shuffled)
    assert r.status_code == 422 and "parts must be numbered 1..3 in order, got [1, 3, 2]" in str(r.json()["detail"])
    assert [upload for _, upload, _ in blobs.list_multipart()] == [ticket.upload_id]
    # an ETag that is not the part's: the bucket refuses to join them, the upload is aborted
    wrong = _commit(lease, ticket, payload, [parts[0], {**parts[1], "etag": parts[0]["etag"]}, parts[2]])
    r = island.request("POST", commit_url, what="commit", json=wrong)
    assert r.status_code == 422
    assert r.json()["detail"].startswith(
        f"the bucket refused to join the parts: multipart upload {ticket.upload_id!r} to {ticket.key}: InvalidPart: "
    )
    # nothing changed: no contribution, the lease still active, nothing staged, the parts gone
    assert multipart.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["count"] == 0
    (held,) = multipart.get(f"/v1/leases?run_id={run['id']}", headers=A).json()["data"]
    assert held["id"] == lease.lease_id and held["status"] == "active"
    assert blobs.staged_head(ticket.key, 8) is None and list(blobs.list_multipart()) == []
    # the island can still deliver: a new ticket, the parts again
    assert island.upload_direct(lease, payload, tokens=1, train_loss=1.0).status == "accepted"


def test_a_commit_retried_after_its_parts_were_joined_is_accepted(multipart: TestClient) -> None:
    """A commit that joined the parts and then failed (a 5xx, a lost answer) is sent again: the upload id is gone,
    the object is there with the committed size, and that is the join done."""
    _, island, lease, payload = _wide_lease(multipart, "rejoin")
    ticket = request_ticket(island, lease, payload)
    parts = _put_parts(ticket, payload)
    assert ticket.upload_id is not None
    app_blobs(multipart).complete_multipart(ticket.key, ticket.upload_id, [(p["number"], p["etag"]) for p in parts])
    r = island.request(
        "POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=_commit(lease, ticket, payload, parts)
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "accepted"


def test_the_sweep_aborts_unfinished_uploads_of_leases_that_are_over(multipart: TestClient, clock: FakeClock) -> None:
    """Begun more than the grace ago, and its lease no longer pending (here: released): aborted, its parts gone.
    The other, whose lease is still active, is left alone. (moto answers every upload's `Initiated` with one fixed
    date in 2010, so the grace itself is not exercised here; the staged objects' sweep tests it.)"""
    create_running_run(multipart, name="abandoned")
    blobs = app_blobs(multipart)
    state = multipart.app.state.dipaco  # type: ignore[attr-defined]
    islands = [island_client(multipart, f"abandoned-{i}") for i in range(2)]
    leases = [island.lease() for island in islands]
    uploads = []
    for island, lease in zip(islands, leases, strict=True):
        assert lease is not None
        uploads.append(request_ticket(island, lease, b"\0" * (7 << 20)).upload_id)
    islands[0].release(leases[0].lease_id)  # type: ignore[union-attr]
    with state.sessions() as session:
        assert sweep_staging(session, blobs, now=clock.now, grace_s=3600) == 1
    assert [upload for _, upload, _ in blobs.list_multipart()] == [uploads[1]]
