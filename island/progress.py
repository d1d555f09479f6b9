"""The progress bar of one lease's inner steps: round, path, step m/n, loss, tokens/s, elapsed time.

Showing the loss costs a device sync (the loss is a tensor on the device until read), so the bar reads it at
most a few times a second (`LOSS_READ_EVERY_S`) and on the last step, never every step; in between it only
advances. The bar redraws from rich's own thread, twice a second: fewer redraws take less of the GIL from
training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import TracebackType

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

LOSS_READ_EVERY_S = 0.25
"""Shortest time between two reads of the loss (each one synchronises the device)."""


class LeaseProgress:
    """`with LeaseProgress(...) as bar:` around the inner phase; pass `bar.step` as its `after_step`."""

    def __init__(
        self,
        console: Console,
        *,
        round: int,
        path_index: int,
        steps: int,
        tokens_per_step: int,
        quiet: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.steps = steps
        self.tokens_per_step = tokens_per_step
        self.quiet = quiet
        self._round = round
        self._path_index = path_index
        self._bar = Progress(
            TextColumn("round {task.fields[round]} path {task.fields[path]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            console=console,
            disable=quiet,
            transient=False,
            refresh_per_second=2,
        )
        self._clock = clock
        self._task: TaskID | None = None
        self._t0 = 0.0
        self._last_read = -math.inf  # the first step shows its loss

    def __enter__(self) -> LeaseProgress:
        self._bar.__enter__()
        self._task = self._bar.add_task(
            "train", total=self.steps, round=self._round, path=self._path_index, loss="-", tps="-"
        )
        self._t0 = self._clock()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.__exit__(exc_type, exc, tb)

    def step(self, i: int, loss: torch.Tensor) -> None:
        """Step `i` (0-based) is done with rank-local loss `loss` (still on the device)."""
        if self.quiet or self._task is None:
            return
        now = self._clock()
        if now - self._last_read < LOSS_READ_EVERY_S and i + 1 < self.steps:
            self._bar.update(self._task, advance=1)
            return
        self._last_read = now
        value = float(loss)
        self._bar.update(
            self._task,
            advance=1,
            loss=f"{value:.4f}" if math.isfinite(value) else str(value),
            tps=f"{self.tokens_per_step * (i + 1) / max(now - self._t0, 1e-9):.0f}",
        )
