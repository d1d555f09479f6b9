"""Fault injection for integration tests, keyed by (round, step); off unless the environment asks for it.

`DIPACO_ISLAND_FAULT_STALL="ROUND:STEP:SECONDS"`: before inner step STEP of a lease for round ROUND the island
logs `fault injection: stalling ...` and waits SECONDS (heartbeats go on, so the lease stays active; a stop
signal ends the wait). ROUND may be `*`: every lease stalls (a lease of an async level counts its path's leases
as rounds). Tests use it to hold a lease long enough to kill the island or the coordinator under it, or to
make uploads of another island arrive while it holds one.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

STALL_ENV = "DIPACO_ISLAND_FAULT_STALL"


@dataclass(frozen=True, slots=True)
class Stall:
    round: int | None
    """None: every round."""
    step: int
    seconds: float

    @classmethod
    def from_env(cls) -> Stall | None:
        raw = os.environ.get(STALL_ENV)
        if not raw:
            return None
        try:
            rnd, step, seconds = raw.split(":")
            return cls(round=None if rnd == "*" else int(rnd), step=int(step), seconds=float(seconds))
        except ValueError as exc:
            raise ValueError(f"{STALL_ENV} must be ROUND:STEP:SECONDS (ROUND may be *), got {raw!r}") from exc

    def maybe_stall(self, *, lease_id: int, round: int, step: int, stop: threading.Event) -> None:
        if step == self.step and self.round in (None, round):
            log.warning(
                "fault injection: stalling lease %d (round %d) before step %d for %.1fs",
                lease_id,
                round,
                step,
                self.seconds,
            )
            stop.wait(self.seconds)
