"""Background heartbeats: keep the island (and its lease) alive and notice when the lease is lost.

The training loop checks `lease_lost` between steps; the coordinator's reply is authoritative, so a lease id
missing from `active_lease_ids` means the work must be abandoned.
"""

from __future__ import annotations

import logging
import threading

from island.client import CoordinatorClient
from island.errors import ClientError, CoordinatorUnavailable, IslandError, RequestRejected

log = logging.getLogger(__name__)


class Heartbeater:
    """Sends a heartbeat every `interval_s` in a daemon thread and tracks the current lease."""

    def __init__(self, client: CoordinatorClient, *, interval_s: float) -> None:
        self._client = client
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fatal: IslandError | ClientError | None = None
        """Set when the coordinator rejected a heartbeat (e.g. island revoked): the island must stop."""
        self.beats = 0

    # -- lease tracking (main thread) --------------------------------------------------------------------

    def watch(self, lease_id: int | None) -> None:
        """Track a new lease (or none); clears the lost flag."""
        with self._lock:
            self._lease_id = lease_id
            self._lost.clear()

    @property
    def lease_lost(self) -> bool:
        return self._lost.is_set()

    # -- beating -------------------------------------------------------------------------------------------

    def beat_once(self) -> None:
        """One heartbeat; flags the watched lease as lost if the reply no longer lists it."""
        with self._lock:
            watched = self._lease_id
        # A short retry budget: the next beat comes soon, and the main loop reports a dead coordinator.
        reply = self._client.heartbeat(give_up_after_s=max(self.interval_s, 1.0))
        self.beats += 1
        if reply.heartbeat_interval_s > 0:
            self.interval_s = reply.heartbeat_interval_s
        with self._lock:
            # Only judge the lease that was current when the beat was sent; the main loop may have moved on.
            if watched is not None and watched == self._lease_id and watched not in reply.active_lease_ids:
                log.warning("lease %d is no longer active on the coordinator; abandoning it", watched)
                self._lost.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat_once()
            except CoordinatorUnavailable as exc:
                log.warning("heartbeat failed: %s", exc)
            except RequestRejected as exc:
                log.error("heartbeat rejected: %s", exc)
                self.fatal = exc
                self._lost.set()
                return
            except Exception as exc:  # never let the thread die silently
                log.exception("heartbeat thread crashed")
                self.fatal = IslandError(f"heartbeat thread crashed: {exc!r}")
                self._lost.set()
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dipaco-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
