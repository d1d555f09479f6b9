"""Island.run() end to end against the REAL coordinator app (debug model, CPU).

The island reaches the app through `FaultyTransport` (tests/island/faulty_transport.py); a test injects a fault
only where the app cannot produce one itself (5xx bursts, refused connections, lost replies, corrupt bytes) and
uses `Before` hooks to act on the coordinator at an exact point (its fake clock past a lease's expiry, a rival
island, a stop request). What the island uploaded is read back from the coordinator's blob store and checked
bit for bit against an in-process replay, and the module versions the rounds produced against
`modules.outer_update` applied to that replay.
"""

from __future__ import annotations

import copy
import hashlib
import io
import logging
import os
import signal
import threading
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console

from coordinator.schemas import GRAD_KEY_SEP, IslandCapabilities, LeasePublic
from coordinator.services import apply as apply_service
from island.client import CoordinatorClient
from island.errors import LeaseLost
from island.faults import STALL_ENV
from island.heartbeat import Heartbeater
from island.worker import EXIT_ERROR, EXIT_INTEGRITY, EXIT_OK, EXIT_UNAVAILABLE, Island, IslandConfig
from modules import (
    InnerConfig,
    ModelConfig,
    OuterConfig,
    batches_from_tokens,
    build_path,
    decode,
    heldout_loss,
    make_optimizer,
    outer_update,
    pseudo_gradient,
    train_steps,
)
from modules.codec import read_metadata
from tests.conftest import JOIN
from tests.coordinator.helpers import A, upload, wait_applied
from tests.coordinator.helpers import join as join_as
from tests.coordinator.helpers import lease as lease_for
from tests.island.faulty_transport import Before, Corrupt, Drop, FaultyTransport, LoseReply, Reply
from tests.island.real_coordinator import ONE_PATH, TWO_PATHS, Coordinator

Tensors = dict[str, torch.Tensor]

# -- reading back what happened ----------------------------------------------------------------------------------


def leases_of(transport: FaultyTransport) -> dict[int, LeasePublic]:
    """Every lease the coordinator handed to the island, by id: answers to its lease requests, and next leases
    that came with its uploads' replies."""
    replies = [e.reply for e in transport.to("lease") if e.status == 200]
    replies += [e.reply["next_lease"] for e in transport.to("upload") if e.status == 200 and e.reply["next_lease"]]
    return {reply["lease_id"]: LeasePublic.model_validate(reply) for reply in replies}


def accepted(island: Island, transport: FaultyTransport) -> list[LeasePublic]:
    """The leases whose upload the coordinator accepted, in the order the island trained them."""
    leases = leases_of(transport)
    return [leases[r.lease_id] for r in island.results if r.status == "uploaded"]


def stored_upload(coordinator: Coordinator, transport: FaultyTransport, lease_id: int) -> Tensors:
    """The outer gradients of a lease as the coordinator stored them (by the sha256 of what the island sent)."""
    [body] = {e.body for e in transport.to("upload") if e.path == f"/v1/leases/{lease_id}/outer-gradients"}
    stored = coordinator.stored_blob(hashlib.sha256(body).hexdigest())
    assert stored == body
    return decode(stored)


def replay(coordinator: Coordinator, leases: list[LeasePublic], *, capacity: int) -> dict[int, Tensors]:
    """Recompute the outer gradients of accepted `leases` from scratch, the way the island should: base weights and
    tokens from the coordinator, `modules.train_steps`, and the AdamW state of the `capacity` paths trained last."""
    out: dict[int, Tensors] = {}
    saved: OrderedDict[tuple[int, int], dict[str, Any]] = OrderedDict()
    for lease in leases:
        cfg = ModelConfig.from_dict(lease.model)
        inner = InnerConfig(**lease.inner)
        modules = sorted(lease.modules, key=lambda m: m.level)
        base = [coordinator.weights(m.module_id, m.version) for m in modules]
        model = build_path(cfg, base)
        optimizer = make_optimizer(model, inner)
        key = (lease.run_id, lease.path_id)
        if key in saved:
            optimizer.load_state_dict(copy.deepcopy(saved[key]))
        torch.manual_seed(lease.seed)
        tokens = coordinator.tokens(lease)
        batches = batches_from_tokens(tokens, batch_size=inner.batch_size, seq_len=cfg.seq_len, steps=lease.inner_steps)
        train_steps(model, optimizer, batches, inner, first_step=lease.first_step)
        trained = model.state_dict()
        grads: Tensors = {}
        for module, weights in zip(modules, base, strict=True):
            g = pseudo_gradient(weights, {n: trained[n] for n in weights})
            grads.update({f"{module.level_name}{GRAD_KEY_SEP}{n}": t for n, t in g.items()})
        out[lease.lease_id] = grads
        saved[key] = copy.deepcopy(optimizer.state_dict())
        saved.move_to_end(key)
        while len(saved) > capacity:
            saved.popitem(last=False)
    return out


def same(got: Tensors, want: Tensors) -> bool:
    return sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def assert_same(got: Tensors, want: Tensors) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32 and bool(torch.isfinite(got[name]).all()), name
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def assert_rounds_apply(
    coordinator: Coordinator, run: dict[str, Any], leases: list[LeasePublic], grads: dict[int, Tensors]
) -> None:
    """Every module version after round r equals `outer_update` of version r with the outer gradients of round r's
    leases through it, under the run's outer config (all rounds from 0, every contribution in `leases`)."""
    outer = OuterConfig(**run["config"]["outer"])
    assert outer.weighting == "uniform"
    momentum: dict[int, Tensors | None] = {}
    for rnd in sorted({lease.round for lease in leases}):
        through: defaultdict[int, list[Tensors]] = defaultdict(list)
        version: dict[int, int] = {}
        for lease in (lease for lease in leases if lease.round == rnd):
            for m in lease.modules:
                prefix = f"{m.level_name}{GRAD_KEY_SEP}"
                g = grads[lease.lease_id]
                through[m.module_id].append({k.removeprefix(prefix): t for k, t in g.items() if k.startswith(prefix)})
                version[m.module_id] = m.version
        for module_id, module_grads in through.items():
            base = coordinator.weights(module_id, version[module_id])
            want, momentum[module_id] = outer_update(
                base, module_grads, [1.0] * len(module_grads), momentum.get(module_id), outer
            )
            assert_same(coordinator.weights(module_id, version[module_id] + 1), want)


class LogSeen(logging.Handler):
    """Sets `seen` once a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> bool:
    return all(r.exc_info is None for r in caplog.records)


# -- the protocol ------------------------------------------------------------------------------------------------


def test_uploads_equal_a_replay_and_the_rounds_apply_them(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=2)
    island, transport = coordinator.island(quiet=False)
    out = io.StringIO()
    island.console = Console(file=out, width=120, force_terminal=False)
    with caplog.at_level(logging.INFO, logger="island"):
        assert island.run() == EXIT_OK

    assert [(r.round, r.path_index, r.status) for r in island.results] == [(0, 0, "uploaded"), (1, 0, "uploaded")]
    leases = accepted(island, transport)
    replayed = replay(coordinator, leases, capacity=4)
    for lease in leases:
        assert_same(stored_upload(coordinator, transport, lease.lease_id), replayed[lease.lease_id])
    assert_rounds_apply(coordinator, run, leases, replayed)
    # The second lease continued the first one's AdamW state (a fresh optimizer gives other numbers).
    assert not same(replayed[leases[1].lease_id], replay(coordinator, leases[1:], capacity=4)[leases[1].lease_id])

    contributions = coordinator.get("/v1/contributions", run_id=run["id"])["data"]
    assert [c["lease_id"] for c in contributions] == [lease.lease_id for lease in leases]
    for c, result in zip(contributions, island.results, strict=True):
        assert c["tokens"] == run["inner_steps"] * 2 * 16 == result.tokens  # H x batch x seq_len
        assert c["train_loss"] == pytest.approx(sum(result.losses) / len(result.losses))
    assert coordinator.get(f"/v1/runs/{run['id']}")["status"] == "finished"
    assert [e.status for e in transport.to("leave")] == [204] and transport.to("release") == []
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("round 0 path 0: loss") and "tok/s, upload" in m for m in messages)
    assert any(m.startswith("round 1 path 0") and m.endswith("(completed the round)") for m in messages)
    assert "round 1 path 0" in out.getvalue()  # the progress bar was drawn


@pytest.mark.parametrize("capacity", [1, 4], ids=["cache-1", "cache-4"])
def test_inner_state_is_kept_per_path_when_an_island_alternates(coordinator: Coordinator, capacity: int) -> None:
    run = coordinator.create_run(layout=TWO_PATHS, num_rounds=2)
    island, transport = coordinator.island(optimizer_cache=capacity)
    assert island.run() == EXIT_OK

    leases = accepted(island, transport)
    # Both paths in round 0, then both again: the path trained first came back after a lease of the other one.
    assert [lease.round for lease in leases] == [0, 0, 1, 1]
    assert sorted(lease.path_index for lease in leases) == [0, 0, 1, 1]
    replayed = replay(coordinator, leases, capacity=capacity)
    for lease in leases:
        assert_same(stored_upload(coordinator, transport, lease.lease_id), replayed[lease.lease_id])
    assert_rounds_apply(coordinator, run, leases, replayed)
    # The number of paths kept changes the numbers, so the comparison above tells them apart.
    other = replay(coordinator, leases, capacity=5 - capacity)
    assert not all(same(replayed[lease.lease_id], other[lease.lease_id]) for lease in leases)


def test_409_on_upload_discards_the_lease_and_asks_for_new_work(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=2)
    island, transport = coordinator.island()
    app = coordinator.app

    def rival_closes_the_round() -> None:
        """The island's lease expires (no heartbeat in between: 10 s interval) and a rival trains the path and
        closes round 0 before the island's upload arrives."""
        coordinator.clock.advance(run["lease_ttl_s"] + 1)
        rival, headers = join_as(app, "rival")
        body = lease_for(app, rival, headers)
        assert body is not None and (body["round"], body["path_index"]) == (0, 0)
        zeros = {
            f"{m['level_name']}{GRAD_KEY_SEP}{k}": torch.zeros_like(t)
            for m in body["modules"]
            for k, t in coordinator.weights(m["module_id"], m["version"]).items()
        }
        r = upload(app, body, headers, zeros)
        assert r.status_code == 200 and r.json()["round_applied"], r.text
        wait_applied(app, body["run_id"])  # the executors apply the round it completed
        assert app.delete(f"/v1/islands/{rival}", headers=headers).status_code == 204

    transport.inject("upload", Before(rival_closes_the_round))
    with caplog.at_level(logging.WARNING, logger="island"):
        assert island.run() == EXIT_OK

    [fired] = transport.fired
    assert (fired.endpoint, fired.status) == ("upload", 409)
    assert fired.reply == {"detail": "lease 1 was issued for round 0, the run is at round 1"}
    lost, retrained = island.results
    assert (lost.lease_id, lost.round, lost.status) == (1, 0, "lost")
    assert (retrained.round, retrained.status) == (1, "uploaded")
    statuses = [e.status for e in transport.to("lease")]
    assert statuses[:2] == [200, 200] and set(statuses[2:]) == {204}  # lost, trained, then no work ...
    assert transport.to("lease")[-1].headers["x-dipaco-idle"] == "no-running-runs"  # ... once the run finished
    paths = [f"/v1/leases/{n}/outer-gradients" for n in (1, retrained.lease_id)]
    assert [e.path for e in transport.to("upload")] == paths
    assert any("lease 1 lost" in r.getMessage() and "discarding its work" in r.getMessage() for r in caplog.records)
    # The discarded lease's AdamW steps were not kept: the next lease replays from a fresh optimizer.
    leases = leases_of(transport)
    first, second = leases[1], leases[retrained.lease_id]
    fresh = replay(coordinator, [second], capacity=4)[second.lease_id]
    assert_same(stored_upload(coordinator, transport, second.lease_id), fresh)
    assert not same(fresh, replay(coordinator, [first, second], capacity=4)[second.lease_id])


def test_heartbeat_that_no_longer_lists_the_lease_abandons_it(
    make_coordinator: Any, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator: Coordinator = make_coordinator(heartbeat_interval_s=0.05)
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=1)
    island, transport = coordinator.island()

    def expire_the_lease() -> None:
        """While the island fetches its tokens: a heartbeat while the lease is active, then the coordinator's
        clock past its expiry, then heartbeats until one sent after that has been read by the island."""
        transport.wait_for("heartbeat", transport.count("heartbeat") + 2)
        coordinator.clock.advance(run["lease_ttl_s"] + 1)
        transport.wait_for("heartbeat", transport.count("heartbeat") + 3)

    transport.inject("tokens", Before(expire_the_lease))
    with caplog.at_level(logging.WARNING, logger="island"):
        assert island.run() == EXIT_OK

    assert [e.endpoint for e in transport.fired] == ["tokens"]
    beats = [e.reply["active_lease_ids"] for e in transport.to("heartbeat")]
    assert [1] in beats and [] in beats  # listed while active, then no longer
    assert any("lease 1 is no longer active on the coordinator" in r.getMessage() for r in caplog.records)
    assert [(r.lease_id, r.status) for r in island.results] == [(1, "lost"), (2, "uploaded")]
    first, second = leases_of(transport).values()
    assert (second.round, second.path_index) == (first.round, first.path_index)  # back in the pool, same round
    assert [e.path for e in transport.to("upload")] == ["/v1/leases/2/outer-gradients"]
    assert transport.to("release") == []  # an expired lease is not given back


def test_heartbeater_flags_only_the_watched_lease(coordinator: Coordinator) -> None:
    run = coordinator.create_run(layout=ONE_PATH)
    client = CoordinatorClient(str(coordinator.app.base_url), JOIN, http=coordinator.app)
    client.join("beater", "lab", IslandCapabilities())
    lease = client.lease()
    assert lease is not None
    beater = Heartbeater(client, interval_s=1.0)
    beater.beat_once()
    assert not beater.lease_lost and beater.beats == 1
    beater.watch(lease.lease_id)
    beater.beat_once()
    assert not beater.lease_lost
    coordinator.clock.advance(run["lease_ttl_s"] + 1)  # the lease expires: the next reply does not list it
    beater.beat_once()
    assert beater.lease_lost
    beater.watch(None)
    assert not beater.lease_lost
    beater.beat_once()
    assert not beater.lease_lost  # nothing watched, nothing lost


def test_stop_request_while_leasing_releases_the_lease_and_leaves(coordinator: Coordinator) -> None:
    coordinator.create_run(layout=ONE_PATH)
    island, transport = coordinator.island()
    transport.inject("lease", Before(lambda: island.request_stop(signal.SIGTERM)))
    assert island.run() == 128 + signal.SIGTERM
    assert [e.endpoint for e in transport.fired] == ["lease"]
    assert [e.reply for e in transport.to("release")] == [{"lease_id": 1, "status": "released"}]
    assert [e.status for e in transport.to("leave")] == [204] and transport.to("upload") == []
    assert [(r.lease_id, r.status) for r in island.results] == [(1, "stopped")]


def test_stop_request_while_training_releases_the_lease_before_the_next_step(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator.create_run(layout=ONE_PATH)
    island, transport = coordinator.island()
    transport.inject("tokens", Before(lambda: island.request_stop(signal.SIGTERM)))
    with caplog.at_level(logging.INFO, logger="island"):
        assert island.run() == 128 + signal.SIGTERM
    assert [e.endpoint for e in transport.fired] == ["tokens"]
    assert [e.reply for e in transport.to("release")] == [{"lease_id": 1, "status": "released"}]
    assert [e.status for e in transport.to("leave")] == [204] and transport.to("upload") == []
    [result] = island.results
    assert (result.status, result.losses) == ("stopped", [])
    assert "released lease 1 (run 1, round 0, path 0) after 0 of 2 steps" in [r.getMessage() for r in caplog.records]


def test_sigint_is_handled_and_handlers_restored(coordinator: Coordinator) -> None:
    coordinator.create_run(layout=ONE_PATH)
    island, transport = coordinator.island(handle_signals=True)
    transport.inject("lease", Before(lambda: os.kill(os.getpid(), signal.SIGINT)))
    before = signal.getsignal(signal.SIGINT)
    assert island.run() == 130
    assert signal.getsignal(signal.SIGINT) is before
    assert [e.endpoint for e in transport.fired] == ["lease"]
    assert [e.reply for e in transport.to("release")] == [{"lease_id": 1, "status": "released"}]
    assert [e.status for e in transport.to("leave")] == [204]


def test_waits_while_no_run_is_running_then_works_and_honours_max_rounds(coordinator: Coordinator) -> None:
    island, transport = coordinator.island(max_rounds=2)
    runs: list[dict[str, Any]] = []
    # Nothing trained yet, so "no-running-runs" means: wait (Retry-After) and ask again; the run appears meanwhile.
    transport.inject("lease", Before(lambda: runs.append(coordinator.create_run())), attempts=[2])
    assert island.run() == EXIT_OK
    assert [(e.status, e.headers.get("x-dipaco-idle")) for e in transport.to("lease")] == [
        (204, "no-running-runs"),
        (200, None),
    ]  # the second lease came with the first upload's reply
    assert [e.reply["next_lease"] is not None for e in transport.to("upload")] == [True, False]
    assert [r.status for r in island.results] == ["uploaded", "uploaded"]
    [run] = runs
    assert len(coordinator.get("/v1/contributions", run_id=run["id"])["data"]) == 2
    assert coordinator.get(f"/v1/runs/{run['id']}")["status"] == "running"  # the island left a run with work


def test_exit_when_idle_with_nothing_to_do(coordinator: Coordinator) -> None:
    island, transport = coordinator.island(exit_when_idle=True)
    assert island.run() == EXIT_OK
    assert island.results == []
    assert [e.headers.get("x-dipaco-idle") for e in transport.to("lease")] == ["no-running-runs"]
    assert [e.status for e in transport.to("leave")] == [204]


# -- exit codes ----------------------------------------------------------------------------------------------------


def test_rejected_join_exits_1_with_a_log_line_not_a_traceback(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    island, transport = coordinator.island(token="not-the-join-token-000")
    with caplog.at_level(logging.INFO, logger="island"):
        assert island.run() == EXIT_ERROR
    [join] = transport.to("join")
    assert join.status == 401
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"join as 'island-0' rejected with HTTP 401: {join.reply['detail']}"]
    assert no_tracebacks(caplog)


def test_island_revoked_while_training_stops_with_exit_1_and_a_log_line(
    make_coordinator: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STALL_ENV, "0:1:1")  # hold the lease before step 1 for 1 s; heartbeats go on
    coordinator: Coordinator = make_coordinator(heartbeat_interval_s=0.05)
    run = coordinator.create_run(layout=ONE_PATH)
    island, transport = coordinator.island()

    stalling = LogSeen("fault injection: stalling")
    logging.getLogger("island.faults").addHandler(stalling)

    def revoke_once_training() -> None:
        """Hold the first heartbeat until the island stalls inside its inner steps, then revoke the island."""
        assert stalling.seen.wait(30)
        r = coordinator.app.delete(f"/v1/islands/{island.client.island_id}", headers=A)
        assert r.status_code == 204, r.text

    transport.inject("heartbeat", Before(revoke_once_training))
    try:
        with caplog.at_level(logging.INFO, logger="island"):
            assert island.run() == EXIT_ERROR
    finally:
        logging.getLogger("island.faults").removeHandler(stalling)

    [fired] = transport.fired
    assert (fired.endpoint, fired.status) == ("heartbeat", 401)
    assert fired.reply == {"detail": f"island {island.client.island_id}'s token was revoked"}
    rejected = f"heartbeat of island {island.client.island_id} rejected with HTTP 401: {fired.reply['detail']}"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"heartbeat rejected: {rejected}", rejected]  # the heartbeat thread, then run()
    assert no_tracebacks(caplog)
    assert [r.status for r in island.results] == [] and transport.to("upload") == []
    # On the way out the release and the leave are refused too (revoked token), quietly.
    assert [e.status for e in transport.to("release")] == [401] and [e.status for e in transport.to("leave")] == [401]
    assert coordinator.get("/v1/contributions", run_id=run["id"])["count"] == 0


def test_gives_up_on_an_unreachable_coordinator_with_exit_3(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    island, transport = coordinator.island(give_up_after_s=0.05)
    transport.inject("join", Drop(), attempts=None)
    with caplog.at_level(logging.INFO, logger="island"):
        assert island.run() == EXIT_UNAVAILABLE
    joins = transport.to("join")
    assert len(joins) >= 2 and all(e.fault == Drop() and e.status is None for e in joins)
    assert transport.to("leave") == []  # never joined, so nothing to leave
    assert coordinator.get("/v1/islands")["count"] == 0
    assert any("unavailable: join as 'island-0'" in r.getMessage() for r in caplog.records)
    assert no_tracebacks(caplog)


def test_weights_failing_their_hash_twice_exit_4_and_release(coordinator: Coordinator) -> None:
    coordinator.create_run(layout=ONE_PATH)
    island, transport = coordinator.island()
    transport.inject("weights", Corrupt(), attempts=[1, 2])
    assert island.run() == EXIT_INTEGRITY
    assert [(e.endpoint, e.attempt) for e in transport.fired] == [("weights", 1), ("weights", 2)]
    assert transport.to("upload") == []
    assert [e.reply for e in transport.to("release")] == [{"lease_id": 1, "status": "released"}]
    assert [e.status for e in transport.to("leave")] == [204]


def test_one_corrupt_download_is_fetched_again(coordinator: Coordinator) -> None:
    run = coordinator.create_run(layout=ONE_PATH)
    island, transport = coordinator.island(max_rounds=1)
    transport.inject("weights", Corrupt())
    assert island.run() == EXIT_OK
    [fired] = transport.fired
    weights = transport.to("weights")
    assert fired == weights[0] and weights[1].path == weights[0].path  # the same module, fetched again
    [lease] = accepted(island, transport)
    assert_same(stored_upload(coordinator, transport, lease.lease_id), replay(coordinator, [lease], capacity=1)[1])
    assert coordinator.get("/v1/contributions", run_id=run["id"])["count"] == 1


def test_upload_retries_through_a_503_burst(coordinator: Coordinator) -> None:
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=1)
    island, transport = coordinator.island()
    transport.inject("upload", Reply(503, {"Retry-After": "0"}, "overloaded"), attempts=[1, 2])
    assert island.run() == EXIT_OK
    assert [e.status for e in transport.to("upload")] == [503, 503, 200]
    assert len(transport.fired) == 2 and island.client.retries >= 2
    [lease] = accepted(island, transport)
    grads = replay(coordinator, [lease], capacity=1)
    assert_same(stored_upload(coordinator, transport, lease.lease_id), grads[lease.lease_id])
    assert coordinator.get("/v1/contributions", run_id=run["id"])["count"] == 1
    assert_rounds_apply(coordinator, run, [lease], grads)


def test_a_lost_upload_reply_is_retried_and_applied_once(coordinator: Coordinator) -> None:
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=1)
    island, transport = coordinator.island()
    transport.inject("upload", LoseReply(500))  # the coordinator accepts (and applies the round), the reply is lost
    assert island.run() == EXIT_OK
    assert [e.status for e in transport.to("upload")] == [500, 200]
    assert [e.fault for e in transport.fired] == [LoseReply(500)]
    assert [r.status for r in island.results] == ["uploaded"]
    # The retry was answered with the contribution already accepted; the round was applied once.
    [contribution] = coordinator.get("/v1/contributions", run_id=run["id"])["data"]
    assert transport.to("upload")[1].reply["id"] == contribution["id"]
    rounds = coordinator.get(f"/v1/runs/{run['id']}/rounds")["data"]
    assert [(r["number"], r["status"], r["contributions"]) for r in rounds] == [(0, "applied", 1)]
    [lease] = accepted(island, transport)
    grads = replay(coordinator, [lease], capacity=1)
    assert_rounds_apply(coordinator, run, [lease], grads)
    assert {m["version"] for m in coordinator.get("/v1/modules", run_id=run["id"])["data"]} == {1}


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="device"):
        IslandConfig(coordinator="http://testserver", token="t", device="tpu")
    with pytest.raises(ValueError, match="http"):
        IslandConfig(coordinator="coordinator:8000", token="t")
    with pytest.raises(ValueError, match="max_rounds"):
        IslandConfig(coordinator="http://testserver", token="t", max_rounds=0)
    with pytest.raises(ValueError, match="optimizer_cache"):
        IslandConfig(coordinator="http://testserver", token="t", optimizer_cache=0)


def test_int8_run_uploads_quantized_gradients_with_error_feedback(coordinator: Coordinator) -> None:
    """With the run's codec int8, the island's uploads are int8 payloads (about a quarter of fp32) and the
    residual the quantisation lost is kept per path, once the work is accepted, for the next lease."""
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=2, codec="int8")
    island, transport = coordinator.island()
    assert island.run() == EXIT_OK
    leases = accepted(island, transport)
    assert [lease.codec for lease in leases] == ["int8", "int8"]
    contributions = coordinator.get("/v1/contributions", run_id=run["id"])["data"]
    first = replay(coordinator, leases[:1], capacity=1)[leases[0].lease_id]
    params = sum(t.numel() for t in first.values())
    assert [c["codec"] for c in contributions] == ["int8", "int8"]
    assert all(0 < c["upload_bytes"] < 0.3 * 4 * params for c in contributions)
    for upload_exchange in transport.to("upload"):
        assert read_metadata(upload_exchange.body)["dipaco.codec"] == "int8"
    key = (run["id"], leases[0].path_id)
    residual = island._residuals.get(key)
    assert residual is not None and set(residual) == set(
        replay(coordinator, leases[:1], capacity=1)[leases[0].lease_id]
    )
    # the residual is what the second upload lost: compensated gradient minus what was sent
    assert all(float(t.abs().max()) > 0 for t in residual.values())


def test_the_island_scores_each_lease_s_start_weights_on_the_held_out_slice(coordinator: Coordinator) -> None:
    """A run that keeps held-out slices: each lease carries its path's slice, the island scores the weights it was
    given on the run's `heldout_tokens` of it before training, and the history records that loss per round."""
    run = coordinator.create_run(layout=ONE_PATH, num_rounds=2, heldout_tokens=48)
    body = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(3)).numpy().astype("<u2").tobytes()
    r = coordinator.app.post(f"/v1/runs/{run['id']}/shards/0/heldout?num_documents=2", content=body, headers=A)
    assert r.status_code == 201, r.text
    island, transport = coordinator.island()
    assert island.run() == EXIT_OK
    leases = accepted(island, transport)
    assert len(leases) == 2 and all(lease.heldout is not None and lease.heldout.score_tokens == 48 for lease in leases)
    history = coordinator.get(f"/v1/runs/{run['id']}/history")["data"]
    recorded = [rnd["losses"][0]["heldout_loss"] for rnd in history]
    heldout = torch.from_numpy(np.frombuffer(body, dtype="<u2")[:48].astype("int64"))
    for lease, got in zip(leases, recorded, strict=True):
        cfg = ModelConfig.from_dict(lease.model)
        start = build_path(cfg, [coordinator.weights(m.module_id, m.version) for m in lease.modules])
        assert got == pytest.approx(heldout_loss(start, heldout, max_tokens=48), rel=1e-6)
    assert recorded[0] != recorded[1]  # round 1 starts from the weights round 0's outer step wrote
    assert [r.heldout_loss for r in island.results] == recorded


def test_the_next_lease_comes_with_the_upload_when_ready_and_not_after_the_last(coordinator: Coordinator) -> None:
    """Two paths in a round: the first upload's reply carries the island's next lease (the round's other path),
    so the island sends one lease request for two leases; with `--max-rounds` reached the last upload asks for
    none, so no lease is left to give back."""
    run = coordinator.create_run(layout=TWO_PATHS)
    island, transport = coordinator.island(max_rounds=2)
    assert island.run() == EXIT_OK
    assert [r.status for r in island.results] == ["uploaded", "uploaded"]
    assert [e.status for e in transport.to("lease")] == [200]
    [first, last] = [e.reply for e in transport.to("upload")]
    assert first["next_lease"]["path_index"] != transport.to("lease")[0].reply["path_index"]
    assert last["next_lease"] is None and transport.to("release") == []
    assert {lease["status"] for lease in coordinator.get("/v1/leases", run_id=run["id"])["data"]} == {"submitted"}


def test_the_next_lease_is_asked_for_while_the_accepted_state_is_kept_but_not_after_the_last(
    coordinator: Coordinator,
) -> None:
    """An upload whose reply carries no lease (here it closes its round: the next round's lease follows the
    apply) sends the next lease request at once (`Island._ask_early`), before the inner state is copied and
    kept; with `--max-rounds` reached nothing more is asked, so no lease is left to give back."""
    coordinator.create_run(layout=ONE_PATH)
    island, transport = coordinator.island(max_rounds=2)
    seen: list[int] = []
    keep = island._inner_states.accept

    def accept(key: Any, lease_id: int, state: dict[str, Any]) -> None:
        if not seen:
            transport.wait_for("lease", 2)  # answered while this first state is still being kept
        seen.append(transport.count("lease"))
        keep(key, lease_id, state)

    island._inner_states.accept = accept  # type: ignore[method-assign]
    assert island.run() == EXIT_OK
    assert [r.status for r in island.results] == ["uploaded", "uploaded"]
    assert seen[0] >= 2
    endpoints = [e.endpoint for e in transport.exchanges if e.endpoint in ("lease", "upload", "release")]
    assert endpoints[-1] == "upload"  # nothing asked after the last lease, nothing to release
    assert transport.to("release") == []


@contextmanager
def steps_held_until_leased(monkeypatch: pytest.MonkeyPatch, island: Island) -> Iterator[None]:
    """Hold each module step of an overlap run until `island` has in hand the lease that trains through it (a lease
    naming that module's next version without weights), and all of them once the block ends. Without it a step
    may land before the island starts on its lease (an executor woken at once by the upload's commit), and the
    waiting or training through under test never happens."""
    cond = threading.Condition()
    leased: Counter[int] = Counter()
    stepped: Counter[int] = Counter()
    released = False
    step, prepare = apply_service._prepare_step, island._prepare

    def held(session: Any, blobs: Any, claimed: Any, **kwargs: Any) -> Any:
        with cond:
            mid = claimed.module_id
            cond.wait_for(lambda: released or leased[mid] > stepped[mid], timeout=30)  # else the test's checks fail
            stepped[mid] += 1
        return step(session, blobs, claimed, **kwargs)

    def prepared(lease: LeasePublic) -> Any:
        with cond:
            leased.update(m.module_id for m in lease.modules if m.weights_hash is None)
            cond.notify_all()
        return prepare(lease)

    monkeypatch.setattr(apply_service, "_prepare_step", held)
    island._prepare = prepared  # type: ignore[method-assign]
    try:
        yield
    finally:
        with cond:
            released = True
            cond.notify_all()


def test_an_overlap_lease_trains_on_from_the_end_weights_and_moves_onto_the_landed_versions(
    coordinator: Coordinator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run field `overlap`, one path, a module step per upload (dn_period 1): each upload's reply carries the next
    lease, whose modules are the versions that step will make, without weights. With `overlap_wait` 0 the island
    trains on at once from its own end weights of the path, and when the versions land (`GET
    /v1/leases/{id}/modules`), moves the model by (landed - end weights) before its next step; its outer gradient
    is taken against the landed versions. Replayed bit for bit: end weights, the steps before the rebase, the
    shift, the steps after it."""
    run = coordinator.create_run(layout=ONE_PATH, sync="async", dn_period=1, overlap=True)
    island, transport = coordinator.island(max_rounds=3, overlap_wait=0.0)
    with steps_held_until_leased(monkeypatch, island):
        assert island.run() == EXIT_OK
    assert [r.status for r in island.results] == ["uploaded"] * 3
    assert [e.status for e in transport.to("lease")] == [200]  # the other two came with the uploads
    leases = accepted(island, transport)
    assert all(m.weights_hash is None for lease in leases[1:] for m in lease.modules)
    assert [r.rebased_at is not None for r in island.results] == [False, True, True]
    assert transport.to("landed") and all(e.status == 200 for e in transport.to("landed"))
    parts = coordinator.get("/v1/contributions", run_id=run["id"])["data"]
    assert sorted({(m["base_version"], m["staleness"]) for c in parts for m in c["modules"]}) == [
        (0, 0),
        (1, 0),
        (2, 0),
    ]
    ends: list[Tensors] | None = None
    saved: dict[str, Any] | None = None
    for lease, result in zip(leases, island.results, strict=True):
        cfg, inner = ModelConfig.from_dict(lease.model), InnerConfig(**lease.inner)
        modules = sorted(lease.modules, key=lambda m: m.level)
        landed = [coordinator.weights(m.module_id, m.version) for m in modules]
        start = landed if result.rebased_at is None else ends
        assert start is not None
        model = build_path(cfg, start)
        optimizer = make_optimizer(model, inner)
        if saved is not None:
            optimizer.load_state_dict(copy.deepcopy(saved))
        torch.manual_seed(lease.seed)
        batches = batches_from_tokens(
            coordinator.tokens(lease), batch_size=inner.batch_size, seq_len=cfg.seq_len, steps=lease.inner_steps
        )
        k = lease.inner_steps if result.rebased_at is None else result.rebased_at
        train_steps(model, optimizer, batches[:k], inner, first_step=lease.first_step)
        if result.rebased_at is not None:
            state = model.state_dict()
            with torch.no_grad():
                for new, old in zip(landed, start, strict=True):
                    for name in new:
                        state[name].add_(new[name] - old[name])
        train_steps(model, optimizer, batches[k:], inner, first_step=lease.first_step + k)
        trained = model.state_dict()
        want: Tensors = {}
        for module, weights in zip(modules, landed, strict=True):
            g = pseudo_gradient(weights, {n: trained[n] for n in weights})
            want.update({f"{module.level_name}{GRAD_KEY_SEP}{n}": t for n, t in g.items()})
        assert_same(stored_upload(coordinator, transport, lease.lease_id), want)
        ends = [{n: trained[n].clone() for n in weights} for weights in landed]
        saved = copy.deepcopy(optimizer.state_dict())


def test_an_overlap_lease_waits_for_its_versions_before_its_first_step(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default `overlap_wait` (0.1 of the lease's expected training time) an overlap lease whose versions
    land in time moves onto them before its first step: it trains exactly as a lease issued with those versions
    would (the replay starts from the landed weights), and the wait is kept out of its training time."""
    coordinator.create_run(layout=ONE_PATH, sync="async", dn_period=1, overlap=True)
    island, transport = coordinator.island(max_rounds=3)
    fetch = island._landed_weights

    def slow_fetch(lease: LeasePublic, inputs: Any) -> Any:
        time.sleep(0.05)  # the versions land while the lease waits
        return fetch(lease, inputs)

    island._landed_weights = slow_fetch  # type: ignore[method-assign]
    wait_s: list[float] = []
    plan = island._overlap_wait_s

    def planned(lease: LeasePublic) -> float:
        wait_s.append(plan(lease))
        return 60.0  # a tiny model's 0.1 share is milliseconds: long enough here that the 50 ms fetch lands first

    island._overlap_wait_s = planned  # type: ignore[method-assign]
    with steps_held_until_leased(monkeypatch, island):
        assert island.run() == EXIT_OK
    assert [(r.status, r.rebased_at) for r in island.results] == [("uploaded", None), ("uploaded", 0), ("uploaded", 0)]
    leases = accepted(island, transport)
    assert (
        wait_s
        == [  # from the lease before: 0.1 x its time per step x this lease's H
            pytest.approx(0.1 * before.train_s / len(before.losses) * lease.inner_steps)
            for before, lease in zip(island.results, leases[1:], strict=False)
        ]
    )
    for r in island.results[1:]:
        assert r.landed_wait_s is not None and 0.04 < r.landed_wait_s < 5
    want = replay(coordinator, leases, capacity=4)
    for lease in leases:
        got = stored_upload(coordinator, transport, lease.lease_id)
        for name in want[lease.lease_id]:  # end weights + (landed - end weights): the landed ones up to rounding
            torch.testing.assert_close(got[name], want[lease.lease_id][name], rtol=0, atol=1e-6, msg=name)


def test_an_overlap_lease_trains_through_versions_that_land_after_its_wait(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the versions have not landed within the wait, the lease trains on from its end weights and moves onto
    them later (here the fetch takes longer than the whole lease, so after its last step)."""
    coordinator.create_run(layout=ONE_PATH, sync="async", dn_period=1, overlap=True)
    island, _ = coordinator.island(max_rounds=2)
    fetch = island._landed_weights

    def late(lease: LeasePublic, inputs: Any) -> Any:
        time.sleep(1.0)
        return fetch(lease, inputs)

    island._landed_weights = late  # type: ignore[method-assign]
    island._overlap_wait_s = lambda lease: 0.05  # type: ignore[method-assign]
    with steps_held_until_leased(monkeypatch, island):
        assert island.run() == EXIT_OK
    second = island.results[1]
    assert second.status == "uploaded" and second.rebased_at == len(second.losses)
    assert second.landed_wait_s is not None and second.landed_wait_s > 0.05


def test_a_stop_request_ends_the_wait_for_the_versions(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop request while an overlap lease waits for its versions before its first step ends the wait at once
    (not after the wait's bound, here 60 s): the lease is released with no step taken."""
    coordinator.create_run(layout=ONE_PATH, sync="async", dn_period=1, overlap=True)
    island, transport = coordinator.island(max_rounds=3)
    gate = threading.Event()

    def stopped_meanwhile(lease: LeasePublic, inputs: Any) -> Any:
        island.request_stop(signal.SIGTERM)
        gate.wait(30)  # the versions never land while the island is stopping
        raise LeaseLost(lease.lease_id, "gone while its module versions were pending")

    island._landed_weights = stopped_meanwhile  # type: ignore[method-assign]
    island._overlap_wait_s = lambda lease: 60.0  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        with steps_held_until_leased(monkeypatch, island):
            assert island.run() == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 10
    finally:
        gate.set()
    assert [(r.status, r.losses) for r in island.results][1:] == [("stopped", [])]
    assert [e.reply["status"] for e in transport.to("release")] == ["released"]


def test_an_overlap_lease_without_end_weights_waits_for_its_versions(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An island that kept no end weights of the path (here forgotten before each lease, as after a restart) trains
    an overlap lease from its versions once they have landed: long polling `GET /v1/leases/{id}/modules`, then
    the same outer gradients as a replay from those versions."""
    coordinator.create_run(layout=ONE_PATH, sync="async", dn_period=1, overlap=True)
    island, transport = coordinator.island(max_rounds=3)
    prepare = island._prepare

    def forgetful(lease: LeasePublic) -> Any:
        island._ends = None
        return prepare(lease)

    island._prepare = forgetful  # type: ignore[method-assign]
    with steps_held_until_leased(monkeypatch, island):
        assert island.run() == EXIT_OK
    assert [(r.status, r.rebased_at) for r in island.results] == [("uploaded", None)] * 3
    leases = accepted(island, transport)
    assert all(m.weights_hash is None for lease in leases[1:] for m in lease.modules)
    assert len(transport.to("landed")) >= 2 and all(e.reply["ready"] for e in transport.to("landed")[-1:])
    want = replay(coordinator, leases, capacity=4)
    for lease in leases:
        assert_same(stored_upload(coordinator, transport, lease.lease_id), want[lease.lease_id])
