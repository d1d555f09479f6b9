"""Fault injection for crash tests: pause the process at a named point so a test can SIGKILL it there.

Set `DIPACO_FAULT_PAUSE_AT=<point>`; when the coordinator (`serve`, or an `apply-worker`) reaches that point it
writes `<data_dir>/fault-<point>.reached` and sleeps until it is killed. Points:
  upload.before_commit  an accepted upload's blobs are written, its database transaction is not committed
  apply.mid_step        a claimed module step's new weights are written, its commit has not begun (the claim is
                        held, no transaction is open)
  apply.before_commit   a round's new module weights are written, the apply transaction is not committed
Never set in production; unset, `point()` is a no-op.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

POINTS = frozenset({"upload.before_commit", "apply.mid_step", "apply.before_commit"})


@dataclass(frozen=True, slots=True)
class FaultInjector:
    pause_at: str | None
    marker_dir: Path

    def __post_init__(self) -> None:
        if self.pause_at is not None and self.pause_at not in POINTS:
            raise ValueError(f"unknown fault point {self.pause_at!r}; known: {sorted(POINTS)}")

    def point(self, name: str) -> None:
        if name != self.pause_at:
            return
        log.warning("fault injection: pausing at %s until killed", name)
        self.marker_dir.mkdir(parents=True, exist_ok=True)  # an apply-worker makes no data directory of its own
        (self.marker_dir / f"fault-{name}.reached").write_text(name)
        while True:
            time.sleep(3600)


NO_FAULTS = FaultInjector(pause_at=None, marker_dir=Path("."))
