"""`LeaseProgress`: the per-lease bar reads the loss (a device sync) at most a few times a second."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from island.progress import LOSS_READ_EVERY_S, LeaseProgress


class CountingLoss(torch.Tensor):
    """A loss tensor that counts how often it is read as a Python float."""

    reads = 0

    def __float__(self) -> float:
        CountingLoss.reads += 1
        return super().__float__()


def loss(value: float) -> torch.Tensor:
    return torch.tensor(value).as_subclass(CountingLoss)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bar(out: io.StringIO, clock: Clock, *, steps: int, quiet: bool = False) -> LeaseProgress:
    console = Console(file=out, width=120, force_terminal=False)
    return LeaseProgress(console, round=3, path_index=1, steps=steps, tokens_per_step=64, quiet=quiet, clock=clock)


def test_loss_is_read_on_the_first_step_then_at_most_every_quarter_second_and_on_the_last() -> None:
    out, clock = io.StringIO(), Clock()
    CountingLoss.reads = 0
    with bar(out, clock, steps=10) as progress:
        for i in range(9):
            progress.step(i, loss(2.0))
            clock.now += LOSS_READ_EVERY_S / 4  # four steps per read interval
        progress.step(9, loss(1.5))
    # step 0 (first), step 4 and step 8 (a quarter second later each), step 9 (last)
    assert CountingLoss.reads == 4
    text = out.getvalue()
    assert "round 3 path 1" in text and "10/10" in text and "loss 1.5000" in text


def test_quiet_never_reads_the_loss() -> None:
    out, clock = io.StringIO(), Clock()
    CountingLoss.reads = 0
    with bar(out, clock, steps=3, quiet=True) as progress:
        for i in range(3):
            progress.step(i, loss(2.0))
    assert CountingLoss.reads == 0 and out.getvalue() == ""
