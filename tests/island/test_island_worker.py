"""Island.run() end to end against the fake coordinator, with a debug model on CPU."""

from __future__ import annotations

import copy
import io
import logging
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console

from coordinator.schemas import GRAD_KEY_SEP, IslandCapabilities, LeasePublic
from island.heartbeat import Heartbeater
from island.worker import EXIT_ERROR, EXIT_INTEGRITY, EXIT_OK, EXIT_UNAVAILABLE, Island, IslandConfig
from modules import (
    InnerConfig,
    ModelConfig,
    batches_from_tokens,
    build_path,
    decode,
    level_param_shapes,
    make_optimizer,
    pseudo_gradient,
    train_steps,
)
from tests.island.island_fakes import BASE_URL, JOIN_TOKEN, FakeCoordinator, Fault


def make_island(fake: FakeCoordinator, tmp_path: Path, **overrides: Any) -> Island:
    config = IslandConfig(
        **{
            "coordinator": BASE_URL,
            "token": JOIN_TOKEN,
            "name": "test-island",
            "device": "cpu",
            "cache_dir": tmp_path / "cache",
            "quiet": True,
            "probe": False,
            "handle_signals": False,
            **overrides,
        }
    )
    return Island(config, client=fake.client(), console=Console(file=io.StringIO(), width=120))


def replay(fake: FakeCoordinator, lease_ids: list[int], *, keep_state: bool = True) -> dict[int, dict[str, Any]]:
    """Recompute the outer gradients of accepted leases from scratch, the way the island should."""
    out: dict[int, dict[str, Any]] = {}
    saved: dict[tuple[int, int], dict[str, Any]] = {}
    for lease_id in lease_ids:
        lease = LeasePublic.model_validate(fake.leases[lease_id])
        cfg = ModelConfig.from_dict(lease.model)
        inner = InnerConfig(**lease.inner)
        base = [decode(fake.blobs[h]) for h in fake.lease_base[lease_id]]
        model = build_path(cfg, base)
        optimizer = make_optimizer(model, inner)
        key = (lease.run_id, lease.path_id)
        if keep_state and key in saved:
            optimizer.load_state_dict(copy.deepcopy(saved[key]))
        torch.manual_seed(lease.seed)
        shard = np.frombuffer(fake.blobs[lease.shard.tokens_hash], dtype="<u2")
        tokens = torch.from_numpy(shard[lease.token_start : lease.token_end].astype("int64"))
        batches = batches_from_tokens(tokens, batch_size=inner.batch_size, seq_len=cfg.seq_len, steps=lease.inner_steps)
        train_steps(model, optimizer, batches, inner, first_step=lease.first_step)
        trained = model.state_dict()
        grads: dict[str, Any] = {}
        for module, weights in zip(lease.modules, base, strict=True):
            g = pseudo_gradient(weights, {n: trained[n] for n in weights})
            grads.update({f"{module.level_name}{GRAD_KEY_SEP}{n}": t for n, t in g.items()})
        out[lease_id] = grads
        saved[key] = copy.deepcopy(optimizer.state_dict())
    return out


@pytest.mark.parametrize("plan", [[0, 0], [0, 3]], ids=["same-path-keeps-adamw", "new-path-resets-adamw"])
def test_run_uploads_outer_gradients_equal_to_a_replay(
    plan: list[int], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeCoordinator(plan=plan)
    out = io.StringIO()
    island = make_island(fake, tmp_path, quiet=False)
    island.console = Console(file=out, width=120, force_terminal=False)
    with caplog.at_level(logging.INFO, logger="island"):
        assert island.run() == EXIT_OK

    assert [u.lease_id for u in fake.uploads] == [1, 2]
    assert [r.status for r in island.results] == ["uploaded", "uploaded"]
    assert fake.left and fake.released == []
    expected_shapes = {
        f"{level.name}{GRAD_KEY_SEP}{name}": shape
        for li, level in enumerate(fake.layout.levels)
        for name, shape in level_param_shapes(fake.model, fake.layout, li).items()
    }
    replayed = replay(fake, [1, 2])
    for upload in fake.uploads:
        grads = decode(upload.body)
        assert {n: tuple(t.shape) for n, t in grads.items()} == expected_shapes
        assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in grads.values())
        assert any(t.abs().max() > 0 for t in grads.values())
        for name, t in grads.items():
            torch.testing.assert_close(t, replayed[upload.lease_id][name], rtol=1e-5, atol=1e-7)
        lease = fake.leases[upload.lease_id]
        assert int(upload.headers["x-dipaco-tokens"]) == lease["inner_steps"] * 2 * fake.model.seq_len
        assert np.isfinite(float(upload.headers["x-dipaco-train-loss"]))

    # The second lease on the same path must have continued the AdamW state; on a new path, reset it.
    fresh = replay(fake, [2], keep_state=False)[2]
    same = all(torch.allclose(decode(fake.uploads[1].body)[n], fresh[n], rtol=1e-5, atol=1e-7) for n in fresh)
    assert same == (plan[0] != plan[1])

    # Round 1 started from the weights the fake's outer step produced, and module blobs were cached.
    assert fake.lease_base[1] != fake.lease_base[2]
    assert any(
        f"round 0 path {plan[0]}: loss" in r.getMessage() and "tok/s, upload" in r.getMessage() for r in caplog.records
    )
    assert "round 1 path" in out.getvalue()  # the progress bar was drawn


def test_inner_state_is_kept_per_path_when_an_island_alternates(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0, 3, 0])
    island = make_island(fake, tmp_path)
    assert island.run() == EXIT_OK
    assert [u.lease_id for u in fake.uploads] == [1, 2, 3]
    replayed = replay(fake, [1, 2, 3])
    third = decode(fake.uploads[2].body)
    for name, t in third.items():
        torch.testing.assert_close(t, replayed[3][name], rtol=1e-5, atol=1e-7)
    # path 0's AdamW state came back after a lease on path 3: not the same as a fresh optimizer
    fresh = replay(fake, [3], keep_state=False)[3]
    assert not all(torch.allclose(third[n], fresh[n], rtol=1e-5, atol=1e-7) for n in fresh)


def test_409_on_upload_discards_the_lease_and_asks_for_new_work(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0, 0])
    fake.conflict_leases.add(1)
    island = make_island(fake, tmp_path)
    assert island.run() == EXIT_OK
    assert [r.status for r in island.results] == ["lost", "uploaded"]
    assert fake.upload_attempts == [1, 2] and [u.lease_id for u in fake.uploads] == [2]
    assert fake.count("POST", r"/v1/islands/7/lease") == 3  # lost, trained, then "no-running-runs"
    # The discarded lease's AdamW steps were not kept: lease 2 replays from a fresh optimizer.
    replayed = replay(fake, [2])[2]
    for name, t in decode(fake.uploads[0].body).items():
        torch.testing.assert_close(t, replayed[name], rtol=1e-5, atol=1e-7)


def test_heartbeat_that_no_longer_lists_the_lease_abandons_it(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[1, 2], inner_steps=20, heartbeat_interval_s=0.01)
    fake.lost_leases.add(1)
    fake.wait_heartbeat_before_tokens = True
    island = make_island(fake, tmp_path)
    assert island.run() == EXIT_OK
    assert [r.status for r in island.results] == ["lost", "uploaded"]
    assert 1 not in fake.upload_attempts and fake.released == []


def test_heartbeater_flags_only_the_watched_lease(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0])
    client = fake.client()
    client.join("x", "lab", IslandCapabilities())
    lease = client.lease()
    assert lease is not None
    beater = Heartbeater(client, interval_s=1.0)
    beater.watch(lease.lease_id)
    beater.beat_once()
    assert not beater.lease_lost
    fake.lost_leases.add(lease.lease_id)
    beater.beat_once()
    assert beater.lease_lost
    beater.watch(None)
    assert not beater.lease_lost


def test_stop_request_releases_the_lease_and_leaves(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0, 1])
    island = make_island(fake, tmp_path)
    fake.on_lease = lambda lease_id: island.request_stop(signal.SIGTERM)
    assert island.run() == 128 + signal.SIGTERM
    assert fake.released == [1] and fake.left and fake.uploads == []
    assert island.results[0].status == "stopped"


def test_sigint_is_handled_and_handlers_restored(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0])
    island = make_island(fake, tmp_path, handle_signals=True)
    fake.on_lease = lambda lease_id: os.kill(os.getpid(), signal.SIGINT)
    before = signal.getsignal(signal.SIGINT)
    assert island.run() == 130
    assert signal.getsignal(signal.SIGINT) is before
    assert fake.released == [1] and fake.left


def test_gives_up_on_an_unreachable_coordinator_with_exit_3(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0])
    fake.fail("join", *[503] * 1000)
    island = make_island(fake, tmp_path)
    island.client.retry.give_up_after_s = 0.05
    assert island.run() == EXIT_UNAVAILABLE
    assert not fake.left  # never joined, so nothing to leave


def test_rejected_request_exits_1(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0])
    fake.fail("join", Fault(401, detail="invalid join token"))
    assert make_island(fake, tmp_path).run() == EXIT_ERROR


def test_weights_failing_their_hash_twice_exit_4_and_release(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0])
    fake.corrupt_weights = 2
    assert make_island(fake, tmp_path).run() == EXIT_INTEGRITY
    assert fake.released == [1] and fake.left


def test_one_corrupt_download_is_fetched_again(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0])
    fake.corrupt_weights = 1
    assert make_island(fake, tmp_path).run() == EXIT_OK
    assert len(fake.uploads) == 1


def test_waits_while_idle_then_works_and_honours_max_rounds(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[0, 1, 2])
    fake.idle_first = [("waiting", "0.01"), ("no-running-runs", "0.01")]  # nothing trained yet: keep polling
    island = make_island(fake, tmp_path, max_rounds=2)
    assert island.run() == EXIT_OK
    assert [u.lease_id for u in fake.uploads] == [1, 2] and fake.plan == [2]


def test_exit_when_idle_with_nothing_to_do(tmp_path: Path) -> None:
    fake = FakeCoordinator(plan=[])
    island = make_island(fake, tmp_path, exit_when_idle=True)
    assert island.run() == EXIT_OK
    assert island.results == [] and fake.left


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="device"):
        IslandConfig(coordinator=BASE_URL, token="t", device="tpu")
    with pytest.raises(ValueError, match="http"):
        IslandConfig(coordinator="coordinator:8000", token="t")
    with pytest.raises(ValueError, match="max_rounds"):
        IslandConfig(coordinator=BASE_URL, token="t", max_rounds=0)
