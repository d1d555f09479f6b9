"""Multi-process islands: N ranks train one lease with DDP; only rank 0 talks to the coordinator.

How work reaches the other ranks (all over the island's own process group, never over the network to the
coordinator):
  1. rank 0 leases, downloads and composes the path as a single-process island would;
  2. it broadcasts a small JSON command (its length, then its UTF-8 bytes as a uint8 tensor: no pickle, unlike
     `broadcast_object_list`): the lease, whether to resume the inner AdamW state, and which lease that state
     belongs to;
  3. it broadcasts the lease's token range as one int64 tensor (followers need neither the cache nor HTTP);
  4. every follower builds the path's architecture and wraps it in DDP, whose constructor broadcasts rank 0's
     parameters, so every rank starts from the downloaded weights;
  5. all ranks run `inner.inner_phase` on their slice of each batch; rank 0 computes and uploads the outer
     gradient. Followers keep their own copy of the inner AdamW state (identical to rank 0's: same averaged
     gradients), promoted to "accepted" only when rank 0 says the lease was accepted.
While idle rank 0 broadcasts `idle` commands so the followers' blocking receive never hits the process-group
timeout; `stop` ends them.

Launch: `dipaco island join --nproc N` starts N-1 follower processes itself (rank 0 is the command's own
process), or run `torchrun --nproc-per-node N -m dipaco island join ...` (RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT from the environment; rank > 0 becomes a follower).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from coordinator.schemas import LeasePublic
from island.capabilities import resolve_device
from island.errors import IslandError
from island.inner import Ranks, inner_phase
from island.optimizer_state import InnerStates
from modules import InnerConfig, ModelConfig, PathModel, batches_from_tokens, make_optimizer

log = logging.getLogger(__name__)

PG_TIMEOUT_ENV = "DIPACO_ISLAND_PG_TIMEOUT_S"
"""Process-group timeout of a multi-process island in seconds (default 1800: longer than the client's give-up
time, so a follower waiting for rank 0 through a coordinator outage does not time out)."""
PARENT_PID_ENV = "DIPACO_ISLAND_PARENT_PID"
"""Set on followers started by `--nproc`: they exit when that process is gone."""


def ranks_from_env() -> Ranks:
    """This process's place in a torchrun-style launch (RANK, WORLD_SIZE); Ranks() when not launched so."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Ranks(rank=int(os.environ.get("RANK", "0")), world_size=world)


def rank_device(base: torch.device) -> torch.device:
    """One GPU per rank (cuda:LOCAL_RANK) on CUDA; CPU ranks share the CPU. A local rank with no GPU of its own
    is an `IslandError` naming the count (NCCL refuses two ranks on one GPU)."""
    if base.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        check_gpus(local + 1)
        return torch.device("cuda", local)
    return base


def check_gpus(nproc: int) -> None:
    """Refuse `nproc` CUDA ranks on a machine with fewer GPUs: each rank takes cuda:LOCAL_RANK."""
    count = torch.cuda.device_count()
    if nproc > count:
        raise IslandError(
            f"{nproc} CUDA processes need {nproc} GPUs (one each: cuda:0..cuda:{nproc - 1}), but this machine has "
            f"{count}; use at most {count} per machine, or --device cpu"
        )


def init_group(ranks: Ranks, device: torch.device) -> None:
    """Join the island's process group (gloo on CPU, NCCL on CUDA) from the torchrun environment."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "1800"))),
    )


def group_failure(exc: BaseException) -> str | None:
    """What failed, in one line, when `exc` is a collective of the island's process group failing (a rank gone
    or stuck: NCCL's `DistError`s, gloo's connection errors and timeouts, which torch raises as a plain
    RuntimeError naming gloo); None for anything else."""
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))):
        return None
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[.../pair.cc:553] " source location
    return text.split(". ")[0] or type(exc).__name__


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; another process may still take it before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_followers(nproc: int, *, device: str) -> list[subprocess.Popen[bytes]]:
    """Make this process rank 0 of `nproc` and start ranks 1..nproc-1 as `python -m island.follower`."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc)}
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    children = []
    for rank in range(1, nproc):
        child_env = {
            **os.environ,
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            PARENT_PID_ENV: str(os.getpid()),
        }
        children.append(subprocess.Popen([sys.executable, "-m", "island.follower", "--device", device], env=child_env))
    return children


class Leader:
    """Rank 0's side of the protocol (used by `Island` when the world size is above 1)."""

    def __init__(self, ranks: Ranks, device: torch.device) -> None:
        self.ranks = ranks
        self.device = device
        self._last_keepalive = 0.0

    def _send(self, command: dict[str, Any]) -> None:
        send_json(command, self.device)

    def announce(self, lease: LeasePublic, tokens: torch.Tensor, *, resume: bool, accepted_lease: int | None) -> None:
        """Send a lease and its token range to every follower."""
        self._send(
            {
                "op": "train",
                "lease": lease.model_dump_json(),
                "num_tokens": int(tokens.numel()),
                "resume": resume,
                "accepted_lease": accepted_lease,
            }
        )
        dist.broadcast(tokens.to(self.device, dtype=torch.int64).contiguous(), src=0)

    def keepalive(self, *, every_s: float = 5.0) -> None:
        """Tell idle followers we are alive (their receive would otherwise time out)."""
        now = time.monotonic()
        if now - self._last_keepalive >= every_s:
            self._send({"op": "idle"})
            self._last_keepalive = now

    def stop(self) -> None:
        try:
            self._send({"op": "stop"})
            dist.barrier()  # every rank has the stop before the group goes away (gloo aborts otherwise)
        finally:
            close_group()


def close_group() -> None:
    """Tear the island's process group down while the interpreter is whole. Garbage that still refers to it
    (DDP wrappers and their reducers, finished work handles, in reference cycles) is collected first, so the
    group's C++ side and its threads go away here, not at interpreter exit, where gloo can abort the process
    ("terminate called without an active exception", seen once in a CI run of the protocol test)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> None:
    """End a follower rank after `close_group`: flush what it logged and printed, then leave without the
    interpreter's and the C++ runtime's teardown, which has nothing left to release and is where a
    torch.distributed process can still abort."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def send_json(command: dict[str, Any], device: torch.device) -> None:
    """Rank 0: broadcast a JSON-able command as its length and its UTF-8 bytes."""
    data = json.dumps(command).encode()
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=device), src=0)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src=0)


def recv_json(device: torch.device) -> dict[str, Any]:
    """Other ranks: receive a command sent with `send_json`."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    command = json.loads(bytes(data.cpu().tolist()).decode())
    if not isinstance(command, dict) or "op" not in command:
        raise RuntimeError(f"rank 0 sent an invalid command: {command!r}")
    return command


@dataclass(slots=True)
class _Trained:
    """A lease this rank trained to the end; its inner state is kept once rank 0 says it was accepted."""

    lease_id: int
    key: tuple[int, int]
    state: dict[str, Any]


class Follower:
    """Ranks 1..N-1: train what rank 0 announces, until it says stop."""

    def __init__(self, ranks: Ranks, device: torch.device) -> None:
        self.ranks = ranks
        self.device = device
        self._trained: _Trained | None = None
        self._states = InnerStates(capacity=1)
        """The last accepted lease's inner state only, as on rank 0 (see island.optimizer_state)."""
        self.leases_trained = 0

    def _recv(self) -> dict[str, Any]:
        return recv_json(self.device)

    def run(self) -> int:
        try:
            while True:
                command = self._recv()
                if command["op"] == "stop":
                    dist.barrier()
                    return 0
                if command["op"] == "train":
                    self._train(command)
        finally:
            close_group()

    def _train(self, command: dict[str, Any]) -> None:
        lease = LeasePublic.model_validate_json(command["lease"])
        tokens = torch.empty(int(command["num_tokens"]), dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, src=0)
        model_cfg = ModelConfig.from_dict(lease.model)
        inner = InnerConfig(**lease.inner)
        # Rank 0 names the lease it last saw accepted: if that is the one trained here last, keep its state.
        trained, self._trained = self._trained, None
        if trained is not None and trained.lease_id == command["accepted_lease"]:
            self._states.accept(trained.key, trained.lease_id, trained.state)
        key = (lease.run_id, lease.path_id)
        model = PathModel(model_cfg).to(self.device)  # DDP overwrites these weights with rank 0's
        optimizer = make_optimizer(model, inner)
        if command["resume"]:
            saved = self._states.get(key)
            if saved is None:
                raise RuntimeError(f"rank {self.ranks.rank}: no inner state of lease {command['accepted_lease']}")
            optimizer.load_state_dict(saved)
        batches = batches_from_tokens(
            tokens.cpu(), batch_size=inner.batch_size, seq_len=model_cfg.seq_len, steps=lease.inner_steps
        )
        losses = inner_phase(
            model, optimizer, batches, inner, first_step=lease.first_step, device=self.device, ranks=self.ranks
        )
        if len(losses) == lease.inner_steps:
            self._trained = _Trained(lease_id=lease.lease_id, key=key, state=optimizer.state_dict())
        self.leases_trained += 1


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0 (our parent under --nproc) is gone, instead of blocking until the group times out."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


FOLLOWER_TERM_GRACE_S = 10.0
"""How long a follower that got SIGTERM keeps following rank 0 before it exits 143 by itself. torchrun's agent
sends SIGTERM to every rank at once (Kubernetes deleting a pod, say): a follower that died at once left rank 0
failing its next collective ("Connection reset by peer") instead of stopping every rank at one step, releasing
its lease and saying `stop`. The agent waits 30 s before it kills what is left."""


def _on_sigterm(signum: int, frame: object) -> None:
    timer = threading.Timer(FOLLOWER_TERM_GRACE_S, os._exit, args=(128 + signal.SIGTERM,))
    timer.daemon = True
    timer.start()


def follower_main(device_name: str) -> int:
    """Entry point of ranks 1..N-1. SIGINT is ignored: a terminal Ctrl-C reaches the whole process group, and
    rank 0 decides (release the lease, then `stop`); SIGTERM gives rank 0 `FOLLOWER_TERM_GRACE_S` to do so."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    ranks = ranks_from_env()
    try:
        device = rank_device(resolve_device(device_name))
        init_group(ranks, device)
        return Follower(ranks, device).run()
    except IslandError as exc:  # e.g. no GPU of its own for this local rank
        log.error("rank %d: %s", ranks.rank, exc)
        return 1
    except Exception as exc:
        failed = group_failure(exc)
        if failed is None:
            raise
        log.error("rank %d: rank 0 is gone or stuck (the island's process group failed: %s)", ranks.rank, failed)
        return 1
