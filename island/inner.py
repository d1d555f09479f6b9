"""The inner phase of one lease (DiLoCo Alg. 1, lines 4-7): H plain-PyTorch AdamW steps, optionally under DDP.

One process or N ranks of a multi-process island run the same function. With N ranks every global batch of
`batch_size` rows is split into N equal slices (rank r takes rows [r*B/N, (r+1)*B/N)); each rank computes the
mean loss of its slice and `DistributedDataParallel` averages the gradients, which equals the gradient of the
mean loss over the whole batch, so the trajectory (and the outer gradient) matches one process within float
tolerance. Clipping runs on the averaged gradients, so it is identical on every rank too.

Stopping must be collective under DDP (a rank that stops early would leave the others blocked in an
all-reduce): before each step rank 0 broadcasts one int, 1 = go on, 0 = stop; every rank follows it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from modules import InnerConfig, PathModel

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]


class PathLoss(nn.Module):
    """`forward(x, y)` = the path's mean next-token loss; DDP only syncs gradients of what runs in `forward`."""

    def __init__(self, model: PathModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


@dataclass(frozen=True, slots=True)
class Ranks:
    """Where this process sits in its island: rank `rank` of `world_size` (1 = no torch.distributed)."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def rows(self, batch_size: int) -> slice:
        """The rows of a global batch this rank trains on."""
        if batch_size % self.world_size:
            raise ValueError(
                f"batch_size {batch_size} is not divisible by the island's {self.world_size} processes; "
                "choose --nproc dividing the run's batch size"
            )
        per = batch_size // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)


def _agree(go: bool, ranks: Ranks, device: torch.device) -> bool:
    """Rank 0's go/stop decision, on every rank."""
    if not ranks.distributed:
        return go
    flag = torch.tensor([1 if go else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def inner_phase(
    model: PathModel,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    cfg: InnerConfig,
    *,
    first_step: int,
    device: torch.device,
    ranks: Ranks = Ranks(),
    before_step: Callable[[int], bool] | None = None,
    after_step: Callable[[int, torch.Tensor], None] | None = None,
) -> list[float]:
    """Train on `batches` (global batches; this rank takes its rows); returns the losses of the steps taken.

    `before_step(i)` (rank 0's answer counts) returns False to stop before step i. `after_step(i, loss)` gets
    the rank-local loss tensor (not synchronised, so it costs no device sync). The returned losses are the
    means over all ranks of the whole global batch; fewer than `len(batches)` when stopped. The forward runs under
    `device_autocast(device)`, so every rank of an island, and the capabilities probe, train in one precision.
    """
    model.train()
    loss_module: nn.Module = PathLoss(model)
    if ranks.distributed:
        # DDP's constructor broadcasts rank 0's parameters and buffers, so every rank starts from rank 0's
        # weights whatever it built locally.
        loss_module = DistributedDataParallel(loss_module, device_ids=[device.index] if device.type == "cuda" else None)
    rows = ranks.rows(batches[0][0].shape[0]) if batches else slice(None)
    autocast = device_autocast(device)
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[torch.Tensor] = []
    for i, (x, y) in enumerate(batches):
        go = before_step(i) if before_step is not None else True
        if not _agree(go, ranks, device):
            break
        x = x[rows].to(device, non_blocking=True)
        y = y[rows].to(device, non_blocking=True)
        lr = cfg.lr_at(first_step + i)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_module(x, y)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        loss = loss.detach()
        losses.append(loss)
        if after_step is not None:
            after_step(i, loss)
    if not losses:
        return []
    stacked = torch.stack(losses).float()
    if ranks.distributed:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        stacked /= ranks.world_size
    return [float(v) for v in stacked.cpu()]


def device_autocast(device: torch.device) -> AutocastFactory:
    """The island's mixed precision: bf16 autocast around the forward on CUDA (parameters, gradients and AdamW
    state stay fp32); nothing elsewhere (CPU islands train in fp32)."""
    if device.type != "cuda":
        return contextlib.nullcontext

    def bf16() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast("cuda", dtype=torch.bfloat16)

    return bf16
