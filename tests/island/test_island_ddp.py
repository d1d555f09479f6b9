"""A 2-process gloo island produces the same outer gradient as a 1-process island on the same lease and data.

Ranks run under `torch.multiprocessing.spawn` on CPU; no coordinator is needed. Rank 1 deliberately starts from
different weights: DDP must replace them with rank 0's.
"""

from __future__ import annotations

import copy
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coordinator.schemas import LeaseModule, LeasePublic, LeaseShard
from island.distributed import Follower, Leader, close_group, exit_rank, free_port, group_failure
from island.inner import Ranks, inner_phase
from modules import (
    InnerConfig,
    ModelConfig,
    batches_from_tokens,
    build_path,
    decode,
    encode,
    init_state,
    make_optimizer,
    pseudo_gradient,
)

CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
INNER = InnerConfig(lr=0.01, warmup_steps=0, total_steps=20, batch_size=4, grad_clip=0.5)
STEPS = 5
TOL = 1e-4


def _tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (STEPS * INNER.batch_size * CFG.seq_len + 1,), generator=gen)


def _lease(lease_id: int, round_: int) -> LeasePublic:
    return LeasePublic(
        lease_id=lease_id,
        run_id=1,
        round=round_,
        path_id=7,
        path_index=0,
        model=CFG.to_dict(),
        inner={k: getattr(INNER, k) for k in INNER.__dataclass_fields__},
        inner_steps=STEPS,
        first_step=round_ * STEPS,
        modules=[LeaseModule(level=0, level_name="all", module_id=1, version=round_, weights_hash="0" * 64)],
        shard=LeaseShard(shard_id=1, tokens_hash="0" * 64, num_tokens=10_000),
        token_start=0,
        token_end=STEPS * INNER.batch_size * CFG.seq_len + 1,
        epoch=0,
        seed=0,
        expires_at=datetime(2030, 1, 1, tzinfo=UTC),
        status="active",
    )


def _one_process(rounds: int) -> list[dict[str, torch.Tensor]]:
    """Reference: `rounds` leases of one path on one process, inner AdamW state kept across them."""
    weights = init_state(CFG, seed=0)
    model = build_path(CFG, [weights])
    optimizer = make_optimizer(model, INNER)
    out = []
    for r in range(rounds):
        base = {k: v.clone() for k, v in model.state_dict().items()}
        batches = batches_from_tokens(_tokens(r), batch_size=INNER.batch_size, seq_len=CFG.seq_len, steps=STEPS)
        inner_phase(model, optimizer, batches, INNER, first_step=r * STEPS, device=torch.device("cpu"))
        out.append(pseudo_gradient(base, model.state_dict()))
    return out


def _init(rank: int, world: int, port: int) -> Ranks:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Ranks(rank=rank, world_size=world)


def _inner_phase_worker(rank: int, world: int, port: int, out: str) -> None:
    ranks = _init(rank, world, port)
    model = build_path(CFG, [init_state(CFG, seed=0 if rank == 0 else 123)])
    base = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, INNER)
    batches = batches_from_tokens(_tokens(0), batch_size=INNER.batch_size, seq_len=CFG.seq_len, steps=STEPS)
    inner_phase(model, optimizer, batches, INNER, first_step=0, device=torch.device("cpu"), ranks=ranks)
    if rank == 0:
        Path(out).write_bytes(encode(pseudo_gradient(base, model.state_dict())))
    dist.barrier()  # no rank tears the group down while another still talks to it
    close_group()
    exit_rank(0)  # as a follower rank of an island ends: no interpreter teardown after the group is gone


def _protocol_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 plays the island (two leases of one path, then stop); the others run `Follower`."""
    ranks = _init(rank, world, port)
    device = torch.device("cpu")
    if rank > 0:
        follower = Follower(ranks, device)
        follower.run()
        assert follower.leases_trained == 2
        exit_rank(0)
    leader = Leader(ranks, device)
    leader.keepalive()  # followers must skip idle commands
    model = build_path(CFG, [init_state(CFG, seed=0)])
    optimizer = make_optimizer(model, INNER)
    accepted: int | None = None
    for r in range(2):
        lease = _lease(lease_id=10 + r, round_=r)
        base = {k: v.clone() for k, v in model.state_dict().items()}
        tokens = _tokens(r)
        leader.announce(lease, tokens, resume=r > 0, accepted_lease=accepted)
        batches = batches_from_tokens(tokens, batch_size=INNER.batch_size, seq_len=CFG.seq_len, steps=STEPS)
        inner_phase(model, optimizer, batches, INNER, first_step=lease.first_step, device=device, ranks=ranks)
        Path(f"{out}.{r}").write_bytes(encode(pseudo_gradient(base, model.state_dict())))
        accepted = lease.lease_id
        # Rank 0 keeps a CPU copy and reloads it, as the island does between leases.
        state = copy.deepcopy(optimizer.state_dict())
        optimizer = make_optimizer(model, INNER)
        optimizer.load_state_dict(state)
    leader.stop()
    exit_rank(0)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert want[name].abs().max() > 0, name  # the step did something
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=TOL, msg=name)


@pytest.mark.timeout(120)
def test_two_gloo_ranks_give_the_one_process_outer_gradient(tmp_path: Path) -> None:
    out = tmp_path / "grads.safetensors"
    mp.spawn(_inner_phase_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    _assert_close(decode(out.read_bytes()), _one_process(1)[0])


@pytest.mark.timeout(120)
def test_leader_follower_protocol_matches_one_process_across_two_leases(tmp_path: Path) -> None:
    out = tmp_path / "grads"
    mp.spawn(_protocol_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    want = _one_process(2)
    for r in range(2):
        _assert_close(decode((tmp_path / f"grads.{r}").read_bytes()), want[r])


def test_batch_not_divisible_by_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        Ranks(rank=0, world_size=3).rows(4)
    assert Ranks(rank=1, world_size=2).rows(4) == slice(2, 4)


def test_group_failure_names_a_failed_collective_in_one_line_and_nothing_else() -> None:
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer\n"
        "[127.0.0.1]:23220. This is typically caused by a remote worker crashing. GLHF!"
    )
    assert group_failure(gloo) == "Connection closed by peer [127.0.0.1]:23220"
    assert group_failure(dist.DistBackendError("NCCL communicator was aborted")) == ("NCCL communicator was aborted")
    assert group_failure(RuntimeError("shape mismatch")) is None
    assert group_failure(ValueError("gloo")) is None
