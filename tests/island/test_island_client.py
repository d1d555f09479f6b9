"""The island's CoordinatorClient against the REAL coordinator app: retries, Retry-After, give-up, 4xx, integrity,
uploads. Faults the app cannot produce (5xx bursts, refused connections, lost replies, corrupt bytes) come from
`FaultyTransport`; every test asserts that its fault fired as well as the behaviour."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from coordinator.schemas import IslandCapabilities, LeasePublic
from island.client import CoordinatorClient, RetryPolicy
from island.errors import CoordinatorUnavailable, IntegrityError, LeaseLost, RequestRejected
from modules import decode, encode
from tests.conftest import JOIN
from tests.coordinator.helpers import A
from tests.island.faulty_transport import Corrupt, Drop, FaultyTransport, LoseReply, Reply
from tests.island.real_coordinator import ONE_PATH, Coordinator


class FakeSleep:
    """Deterministic time for the retry loop: `sleep` advances `now`, so budgets run out without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def client_for(
    coordinator: Coordinator, *, clock: FakeSleep | None = None, join: bool = True, **retry: float
) -> tuple[CoordinatorClient, FaultyTransport]:
    transport = coordinator.transport()
    base_url = str(coordinator.app.base_url)
    http = httpx.Client(transport=transport, base_url=base_url)
    policy = RetryPolicy(**{"give_up_after_s": 2.0, "base_s": 0.001, "cap_s": 0.01, **retry})
    timing = {} if clock is None else {"sleep": clock.sleep, "clock": clock}
    client = CoordinatorClient(base_url, JOIN, http=http, retry=policy, **timing)
    if join:
        client.join("test-island", "lab", IslandCapabilities())
    return client, transport


def zero_gradients(client: CoordinatorClient, lease: LeasePublic) -> bytes:
    """A valid upload for the lease: zeros shaped like every module of its path."""
    grads = {}
    for m in lease.modules:
        weights = decode(client.module_weights(m.module_id, m.version, m.weights_hash))
        grads.update({f"{m.level_name}/{name}": t * 0 for name, t in weights.items()})
    return encode(grads)


def test_join_switches_to_the_island_token(coordinator: Coordinator) -> None:
    client, transport = client_for(coordinator)
    assert client.island_id is not None
    # island endpoints refuse the join token (403), so this heartbeat went out with the island token
    assert client.heartbeat().active_lease_ids == []
    [join] = transport.to("join")
    [beat] = transport.to("heartbeat")
    assert join.request_headers["authorization"] == f"Bearer {JOIN}"
    assert beat.request_headers["authorization"] != f"Bearer {JOIN}" and beat.status == 200


def test_retries_503_then_succeeds_and_counts_attempts(coordinator: Coordinator) -> None:
    coordinator.create_run(layout=ONE_PATH)
    clock = FakeSleep()
    client, transport = client_for(coordinator, clock=clock)
    transport.inject("lease", Reply(503), attempts=(1, 2))
    lease = client.lease()
    assert lease is not None and lease.path_index == 0
    assert [e.status for e in transport.to("lease")] == [503, 503, 200]
    assert client.retries == 2
    assert len(clock.sleeps) == 2 and all(0 <= s <= 0.002 for s in clock.sleeps)  # full jitter, capped


def test_connection_errors_are_retried(coordinator: Coordinator) -> None:
    clock = FakeSleep()
    client, transport = client_for(coordinator, clock=clock, join=False, base_s=0.01, cap_s=0.01)
    transport.inject("join", Drop(), attempts=(1, 2))
    joined = client.join("x", "lab", IslandCapabilities())
    assert joined.island_id == client.island_id
    assert [e.status for e in transport.to("join")] == [None, None, 201]
    assert client.retries == 2
    islands = coordinator.get("/v1/islands")
    assert [i["name"] for i in islands["data"]] == ["x"]  # refused connections joined nothing


def test_retry_after_is_honoured(coordinator: Coordinator) -> None:
    clock = FakeSleep()
    client, transport = client_for(coordinator, clock=clock)
    transport.inject("heartbeat", Reply(429, {"Retry-After": "0.25"}, "slow down"), attempts=(1,))
    transport.inject("heartbeat", Reply(503, {"Retry-After": "0.5"}), attempts=(2,))
    client.heartbeat()
    assert clock.sleeps == [0.25, 0.5]
    assert [e.status for e in transport.to("heartbeat")] == [429, 503, 200]


def test_gives_up_with_a_useful_message(coordinator: Coordinator) -> None:
    clock = FakeSleep()
    client, transport = client_for(coordinator, clock=clock, give_up_after_s=5.0, base_s=1.0, cap_s=1.0)
    transport.inject("lease", Reply(503, detail="database is locked"), attempts=None)
    with pytest.raises(CoordinatorUnavailable) as info:
        client.lease()
    err = info.value
    assert err.attempts == len(clock.sleeps) + 1 == transport.count("lease") >= 2
    assert err.elapsed_s == pytest.approx(5.0)  # the last sleep is cut to the remaining budget
    message = str(err)
    island = client.island_id
    assert f"lease request of island {island}" in message and f"POST /v1/islands/{island}/lease" in message
    assert f"failed {err.attempts} time(s) over 5.0s" in message
    assert "HTTP 503: database is locked" in message


def test_non_retryable_4xx_raises_request_rejected_with_the_servers_detail(coordinator: Coordinator) -> None:
    client, transport = client_for(coordinator)
    revoked = coordinator.app.delete(f"/v1/islands/{client.island_id}", headers=A)  # an admin revokes it
    assert revoked.status_code == 204
    with pytest.raises(RequestRejected) as info:
        client.lease()
    assert info.value.status == 401
    assert info.value.detail == f"island {client.island_id}'s token was revoked"
    assert client.retries == 0 and transport.count("lease") == 1


def test_no_work_exposes_the_idle_reason(coordinator: Coordinator) -> None:
    client, _ = client_for(coordinator)
    assert client.lease() is None  # no run at all
    assert client.idle is not None and client.idle.reason == "no-running-runs" and client.idle.retry_after_s == 2.0
    coordinator.create_run(layout=ONE_PATH)
    other, _ = client_for(coordinator)
    assert other.lease() is not None  # the only path is taken
    assert client.lease() is None
    assert client.idle.reason == "waiting" and client.idle.retry_after_s == 2.0


def test_weights_are_hash_verified(coordinator: Coordinator) -> None:
    coordinator.create_run(layout=ONE_PATH)
    client, transport = client_for(coordinator)
    lease = client.lease()
    assert lease is not None
    module = lease.modules[0]
    assert len(client.module_weights(module.module_id, module.version, module.weights_hash)) > 0
    transport.inject_next("weights", Corrupt())
    with pytest.raises(IntegrityError) as info:
        client.module_weights(module.module_id, module.version, module.weights_hash)
    assert info.value.expected == module.weights_hash and info.value.actual != module.weights_hash
    assert isinstance(transport.to("weights")[-1].fault, Corrupt)


def test_upload_streams_is_retry_safe_and_409_means_lease_lost(coordinator: Coordinator) -> None:
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=3)
    client, transport = client_for(coordinator)
    lease = client.lease()
    assert lease is not None
    payload = zero_gradients(client, lease)
    transport.inject_next("upload", LoseReply(502))  # the coordinator accepts it, the island never hears so
    contribution = client.upload(lease, payload, tokens=123, train_loss=2.5)
    assert contribution.lease_id == lease.lease_id and contribution.tokens == 123
    first, retry = transport.to("upload")
    assert isinstance(first.fault, LoseReply) and (first.status, retry.status) == (502, 200)
    assert first.body == retry.body == payload  # the retried body was sent whole
    assert first.request_headers["content-length"] == str(len(payload))
    assert "transfer-encoding" not in first.request_headers
    assert first.request_headers["x-dipaco-round"] == str(lease.round)
    # one contribution, stored as received, however many times it was sent
    [stored] = coordinator.get("/v1/contributions", run_id=run["id"])["data"]
    assert stored["id"] == contribution.id and coordinator.stored_blob(hashlib.sha256(payload).hexdigest()) == payload
    # a retry of an accepted upload is answered 200 again (idempotent on the server)
    assert client.upload(lease, payload, tokens=123, train_loss=2.5).id == contribution.id

    second = client.lease(wait_s=10)  # round 1, once the executors applied round 0 (closed by the upload)
    assert second is not None and second.round == 1
    client.release(second.lease_id)
    with pytest.raises(LeaseLost) as info:
        client.upload(second, payload, tokens=1, train_loss=1.0)
    assert info.value.lease_id == second.lease_id
    assert info.value.reason == f"lease {second.lease_id} was released; ask for a new lease"


def test_release_of_a_submitted_lease_is_not_an_error_and_leave_frees_the_island(coordinator: Coordinator) -> None:
    coordinator.create_run(layout=ONE_PATH, num_rounds=2)
    client, transport = client_for(coordinator)
    lease = client.lease()
    assert lease is not None
    client.upload(lease, zero_gradients(client, lease), tokens=1, train_loss=1.0)
    client.release(lease.lease_id)  # 409: already submitted, nothing to give back
    assert transport.to("release")[0].status == 409
    client.leave()
    [island] = coordinator.get("/v1/islands")["data"]
    assert island["status"] == "left"
