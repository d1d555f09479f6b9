"""Progress of long commands (`dipaco eval`, `router refit`, `export`): a line on stderr when the work starts and
then at most one every few seconds, so a person sees it move and a log file stays short. stdout is left to the
result (a table, or JSON with --json)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from coordinator.cli_options import console

if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.schemas import ModulePublic

EVERY_S = 5.0
"""Least seconds between two progress lines."""

M = TypeVar("M")


class Progress:
    """What a command is doing now, printed as `WHAT: STATUS (N s)` at most every `every_s` seconds."""

    def __init__(
        self,
        what: str,
        *,
        out: Console | None = None,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.out = out if out is not None else console(stderr=True)
        self.every_s = every_s
        self.clock = clock
        self.started = self._last = clock()
        self.fetched_bytes = 0

    def update(self, status: str, *, force: bool = False) -> None:
        """Say `status` if `every_s` have passed since the last line, or now with `force`."""
        now = self.clock()
        if force or now - self._last >= self.every_s:
            self._last = now
            self.out.print(f"[dim]{self.what}: {status} ({now - self.started:.0f} s)[/dim]", highlight=False)

    def fetched(self, module: ModulePublic, nbytes: int) -> None:
        """One module's weights were downloaded (`RunPaths.on_fetch`)."""
        self.fetched_bytes += nbytes
        self.update(
            f"fetched module {module.level_name}[{module.index}] v{module.version} "
            f"({self.fetched_bytes / 1e6:.1f} MB so far)"
        )

    def watch_paths(self, build: Callable[[int], M], *, num_paths: int) -> Callable[[int], M]:
        """`build` (path index -> model) that reports which path is being scored and how many batches it ran."""

        def wrapped(path: int) -> M:
            self.update(f"path {path} (of {num_paths}): fetching its modules")
            model = build(path)
            batches = 0

            def on_forward(*_: Any) -> None:
                nonlocal batches
                batches += 1
                self.update(f"path {path} (of {num_paths}): {batches} batch(es) scored")

            model.register_forward_hook(on_forward)  # type: ignore[attr-defined]
            return model

        return wrapped
