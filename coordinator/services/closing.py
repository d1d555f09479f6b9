"""The apply trigger: close the rounds that are ready, then tell the rest of this process.

Rounds are applied by `rounds.apply_ready_rounds` (one transaction each, exactly once). Whoever finds a round
ready calls `RoundCloser.close_ready`: the upload that completed it, a lease request that found no free path
while a deadline had passed, the background sweep, and start-up recovery. The closer then counts the rounds,
hands the next rounds' offers to this process's `OfferBook` and wakes the lease requests waiting for work.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from coordinator.blobstore import BlobStore
from coordinator.faults import FaultInjector
from coordinator.metrics import Metrics
from coordinator.offer_book import OfferBook
from coordinator.services.leases import Affinity
from coordinator.services.rounds import apply_ready_rounds
from coordinator.wakeups import WorkSignal


class RoundCloser:
    """Applies ready rounds for this process (see the module docstring)."""

    def __init__(
        self,
        *,
        blobs: BlobStore,
        affinity: Affinity,
        metrics: Metrics,
        offers: OfferBook,
        wakeups: WorkSignal,
        faults: FaultInjector,
    ) -> None:
        self._blobs = blobs
        self._affinity = affinity
        self._metrics = metrics
        self._offers = offers
        self._wakeups = wakeups
        self._faults = faults

    def close_ready(self, session: Session, run_ids: list[int] | None, *, now: datetime) -> int:
        """Apply the ready rounds of `run_ids` (None: every running run); returns how many were applied.

        Their offers go to the offer book and held lease requests wake (the next rounds are open).
        """
        applied = apply_ready_rounds(
            session, self._blobs, now=now, run_ids=run_ids, faults=self._faults, affinity=self._affinity
        )
        if applied:
            self._metrics.rounds_applied.inc(len(applied))
            self._offers.put([offer for rnd in applied for offer in rnd.offers], now=now)
            self._wakeups.notify()
        return len(applied)
