"""CoordinatorClient against the fake coordinator: retries, Retry-After, give-up, 4xx, integrity, uploads."""

from __future__ import annotations

import httpx
import pytest

from coordinator.schemas import IslandCapabilities
from island.client import CoordinatorClient, RetryPolicy
from island.errors import CoordinatorUnavailable, IntegrityError, LeaseLost, RequestRejected
from modules import decode, encode
from tests.island.island_fakes import BASE_URL, JOIN_TOKEN, FakeCoordinator, Fault


class FakeClock:
    """Deterministic time: `sleep` advances `now`, so retry budgets run without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def joined_client(fake: FakeCoordinator, clock: FakeClock | None = None, **retry: float) -> CoordinatorClient:
    policy = RetryPolicy(**{"give_up_after_s": 2.0, "base_s": 0.001, "cap_s": 0.01, **retry})
    http = httpx.Client(transport=httpx.MockTransport(fake), base_url=BASE_URL)
    if clock is None:
        client = CoordinatorClient(BASE_URL, JOIN_TOKEN, http=http, retry=policy)
    else:
        client = CoordinatorClient(BASE_URL, JOIN_TOKEN, http=http, retry=policy, sleep=clock.sleep, clock=clock)
    client.join("test-island", "lab", IslandCapabilities())
    return client


def test_join_switches_to_the_island_token() -> None:
    fake = FakeCoordinator(plan=[0])
    client = joined_client(fake)
    assert client.island_id == 7
    # The fake answers 401 to anything but the island token on island endpoints.
    assert client.heartbeat().active_lease_ids == []


def test_retries_503_then_succeeds_and_counts_attempts() -> None:
    fake = FakeCoordinator(plan=[0])
    clock = FakeClock()
    client = joined_client(fake, clock)
    fake.fail("lease", 503, 503)
    lease = client.lease()
    assert lease is not None and lease.path_index == 0
    assert fake.count("POST", r"/v1/islands/7/lease") == 3
    assert client.retries == 2
    assert len(clock.sleeps) == 2 and all(0 <= s <= 0.002 for s in clock.sleeps)  # full jitter, capped


def test_connection_errors_are_retried() -> None:
    fake = FakeCoordinator(plan=[0])
    calls = {"n": 0}

    def flaky(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise httpx.ConnectError("connection refused", request=request)
        return fake(request)

    clock = FakeClock()
    http = httpx.Client(transport=httpx.MockTransport(flaky), base_url=BASE_URL)
    client = CoordinatorClient(
        BASE_URL, JOIN_TOKEN, http=http, retry=RetryPolicy(base_s=0.01, cap_s=0.01), sleep=clock.sleep, clock=clock
    )
    assert client.join("x", "lab", IslandCapabilities()).island_id == 7
    assert calls["n"] == 3 and client.retries == 2


def test_retry_after_is_honoured() -> None:
    fake = FakeCoordinator(plan=[0])
    clock = FakeClock()
    client = joined_client(fake, clock)
    fake.fail("heartbeat", Fault(429, {"Retry-After": "0.25"}, "slow down"), Fault(503, {"Retry-After": "0.5"}))
    client.heartbeat()
    assert clock.sleeps == [0.25, 0.5]


def test_gives_up_with_a_useful_message() -> None:
    fake = FakeCoordinator(plan=[0])
    clock = FakeClock()
    client = joined_client(fake, clock, give_up_after_s=5.0, base_s=1.0, cap_s=1.0)
    fake.fail("lease", *[Fault(503, detail="database is locked")] * 100)
    with pytest.raises(CoordinatorUnavailable) as info:
        client.lease()
    err = info.value
    assert err.attempts == len(clock.sleeps) + 1 >= 2
    assert err.elapsed_s == pytest.approx(5.0)  # the last sleep is cut to the remaining budget
    message = str(err)
    assert "lease request of island 7" in message and "POST /v1/islands/7/lease" in message
    assert f"failed {err.attempts} time(s) over 5.0s" in message
    assert "HTTP 503: database is locked" in message


def test_non_retryable_4xx_raises_request_rejected_with_detail() -> None:
    fake = FakeCoordinator(plan=[0])
    client = joined_client(fake)
    fake.fail("lease", Fault(403, detail="island 7 is revoked"))
    with pytest.raises(RequestRejected) as info:
        client.lease()
    assert info.value.status == 403 and info.value.detail == "island 7 is revoked"
    assert client.retries == 0


def test_no_work_exposes_the_idle_reason() -> None:
    fake = FakeCoordinator(plan=[])
    fake.idle_first = [("waiting", "0.5")]
    client = joined_client(fake)
    assert client.lease() is None
    assert client.idle is not None and client.idle.reason == "waiting" and client.idle.retry_after_s == 0.5
    assert client.lease() is None
    assert client.idle.reason == "no-running-runs" and client.idle.retry_after_s == 2.0


def test_weights_are_hash_verified() -> None:
    fake = FakeCoordinator(plan=[0])
    client = joined_client(fake)
    lease = client.lease()
    assert lease is not None
    module = lease.modules[0]
    data = client.module_weights(module.module_id, module.version, module.weights_hash)
    assert len(data) > 0
    fake.corrupt_weights = 1
    with pytest.raises(IntegrityError) as info:
        client.module_weights(module.module_id, module.version, module.weights_hash)
    assert info.value.expected == module.weights_hash and info.value.actual != module.weights_hash


def test_upload_streams_is_retry_safe_and_409_means_lease_lost() -> None:
    fake = FakeCoordinator(plan=[0, 1])
    client = joined_client(fake)
    lease = client.lease()
    assert lease is not None
    weights = client.module_weights(lease.modules[0].module_id, 0, lease.modules[0].weights_hash)
    grads = {f"{lease.modules[0].level_name}/{k}": v * 0 for k, v in decode(weights).items()}
    # The fake applies every module of the lease, so upload gradients for all of them.
    for m in lease.modules[1:]:
        w = decode(client.module_weights(m.module_id, m.version, m.weights_hash))
        grads.update({f"{m.level_name}/{k}": v * 0 for k, v in w.items()})
    payload = encode(grads)
    fake.fail("upload", 502)
    contribution = client.upload(lease, payload, tokens=123, train_loss=2.5)
    assert contribution.lease_id == lease.lease_id and contribution.tokens == 123
    assert fake.upload_attempts == [lease.lease_id, lease.lease_id]
    assert fake.uploads[0].body == payload  # the retried body was sent whole
    assert fake.uploads[0].headers["content-length"] == str(len(payload))
    assert "transfer-encoding" not in fake.uploads[0].headers
    assert fake.uploads[0].headers["x-dipaco-round"] == str(lease.round)
    # A retry of an accepted upload is answered 200 again (idempotent on the server).
    assert client.upload(lease, payload, tokens=123, train_loss=2.5).lease_id == lease.lease_id

    second = client.lease()
    assert second is not None
    fake.conflict_leases.add(second.lease_id)
    with pytest.raises(LeaseLost) as info:
        client.upload(second, payload, tokens=1, train_loss=1.0)
    assert info.value.lease_id == second.lease_id and "round is closed" in info.value.reason


def test_release_of_an_inactive_lease_is_not_an_error() -> None:
    fake = FakeCoordinator(plan=[0])
    client = joined_client(fake)
    lease = client.lease()
    assert lease is not None
    client.release(lease.lease_id)
    client.release(lease.lease_id)  # 409 the second time: nothing to give back
    assert fake.released == [lease.lease_id]
    client.leave()
    assert fake.left
