"""The apply trigger and what follows an apply, for this process.

Whoever finds a round ready calls `RoundCloser.close_ready` (the upload that completed it, a lease request that
found no free path while a deadline had passed, the background sweep, start-up recovery): the round is closed
(`rounds.close_round`: one short transaction) and this process's apply executors are woken. When an executor
of this process commits a step (`RoundCloser.stepped`), the closer counts it and, if that step applied the
round, hands the next round's offers to the `OfferBook` and wakes the lease requests waiting for work.
Executors of other processes are found by the sweeper instead (a new round changes the work signature).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy.orm import Session

from coordinator.metrics import Metrics
from coordinator.models import ModuleStep
from coordinator.offer_book import OfferBook
from coordinator.services.apply import Claimed, StepDone
from coordinator.services.rounds import after_upload, close_ready_rounds, round_closed
from coordinator.wakeups import WorkSignal


class RoundCloser:
    """Closes ready rounds and reacts to the steps this process's executors commit (see the module docstring)."""

    def __init__(self, *, metrics: Metrics, offers: OfferBook, wakeups: WorkSignal) -> None:
        self._metrics = metrics
        self._offers = offers
        self._wakeups = wakeups
        self.executors_wake = threading.Event()
        """Set when this process closed a round: its apply executors look for steps at once."""
        self.claimer: str | None = None
        """The name of this process's apply executor that uploads claim the steps they make due for, when they
        may (`periods.make_due`), and hand over (`hand`); None while it does not run (`--apply-workers 0`)."""
        self._handed: deque[list[Claimed]] = deque()

    def close_ready(self, session: Session, run_ids: list[int] | None, *, now: datetime) -> int:
        """Close the ready rounds of `run_ids` (None: every running run); returns how many were closed."""
        closed = close_ready_rounds(session, now=now, run_ids=run_ids)
        if closed:
            self._metrics.rounds_closed.inc(len(closed))
            self.executors_wake.set()
        return len(closed)

    def closed_with(self, session: Session, run_id: int, number: int, *, now: datetime) -> bool:
        """After an upload into round `number` committed: whether the round stopped taking uploads with it (this
        call closed it, it being ready, or a sweep or another upload already had). One statement when the round
        is not ready, as after most uploads."""
        state = after_upload(session, run_id, number, now)
        if state != "ready":
            return state == "closed"
        return self.close_ready(session, [run_id], now=now) > 0 or round_closed(session, run_id, number)

    def stepped(self, done: StepDone, *, now: datetime) -> None:
        """An executor of this process committed a module step (any thread)."""
        self._metrics.outliers.labels(action="clipped").inc(done.clipped)
        self._metrics.outliers.labels(action="refused").inc(done.refused)
        if done.round_applied:
            self._metrics.rounds_applied.inc()
            self._offers.put(done.offers, now=now)
            self._wakeups.notify()
        elif done.async_step:
            self._wakeups.notify()  # paths held back for this module may lease again

    def async_progress(self, steps: int) -> None:
        """An upload of a run with async levels was accepted (its path is free again) and made `steps` module
        steps due: wake this process's executors and the lease requests waiting for work."""
        if steps:
            self.executors_wake.set()
        self._wakeups.notify()

    def hand(self, steps: Iterable[ModuleStep]) -> None:
        """Hand the `claimer` the steps an upload claimed for it, committed (right after the commit: a claim
        not handed over would wait `claim_s` for another executor), and wake it."""
        claims = [
            Claimed(step_id=s.id, run_id=s.run_id, round=s.round, module_id=s.module_id, attempts=s.attempts)
            for s in steps
        ]
        if claims:
            self._handed.append(claims)
            self.executors_wake.set()

    def take_handed(self) -> list[Claimed]:
        """The claims of one upload handed to the `claimer` (oldest first; empty when there are none); any
        thread."""
        try:
            return self._handed.popleft()
        except IndexError:
            return []
