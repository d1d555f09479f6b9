"""Progress lines of long commands: at most one every `every_s` seconds, forced ones at once, and a scored path
reports its batches through a forward hook."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from dipaco.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_are_spaced_and_paths_report_batches() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress("eval", out=Console(file=out, width=200), every_s=5.0, clock=clock)
    progress.update("starting", force=True)
    progress.update("too soon")
    clock.now += 6
    build = progress.watch_paths(lambda p: torch.nn.Linear(2, 2), num_paths=4)
    model = build(3)  # 6 s after the last line: says which path
    for _ in range(3):
        clock.now += 2
        model(torch.zeros(1, 2))  # every forward pass is a batch; a line when 5 s have passed
    assert out.getvalue().splitlines() == [
        "eval: starting (0 s)",
        "eval: path 3 (of 4): fetching its modules (6 s)",
        "eval: path 3 (of 4): 3 batch(es) scored (12 s)",
    ]
