"""The inner AdamW state an island keeps between leases (DiLoCo, arXiv 2311.08105 Alg. 1: each worker keeps its
inner optimizer state across outer rounds; DiPaCo §2.2: a path resumes where it stopped).

Why only after acceptance: a lease's inner steps belong to the run only once the coordinator accepted its outer
gradient. Work that was discarded (a 409 on upload, a lease lost to its heartbeat, a stop) never reached the
modules, so its moments must not steer the next lease of the path either; the next lease then resumes from the
last accepted one, exactly as an in-process replay of the accepted leases would.

Which states are kept:
  * a single-process island keeps one state per (run, path), the `capacity` most recently accepted, so an
    island that alternates paths resumes each of them;
  * a multi-process island keeps the last accepted lease only (`capacity=1`): rank 0 announces with each lease
    whether to resume and which accepted lease the state belongs to (`last_lease`), and every follower holds its
    own copy of that one state (`island.distributed.Follower`), so all ranks agree on what to resume.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

StateKey = tuple[int, int]
"""(run id, path id)."""


def cpu_copy(obj: Any) -> Any:
    """Deep copy of an optimizer state dict with every tensor cloned to CPU (keeps device memory free)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(v) for v in obj]
    return obj


class InnerStates:
    """Accepted inner optimizer states per (run, path), least recently accepted evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._states: OrderedDict[StateKey, dict[str, Any]] = OrderedDict()
        self.last_lease: int | None = None
        """The lease whose state was accepted last (what a multi-process island's followers hold)."""

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: object) -> bool:
        return key in self._states

    def get(self, key: StateKey) -> dict[str, Any] | None:
        """A fresh CPU copy of the state kept for `key`, ready for `load_state_dict`; None to start afresh.

        A copy, because `Optimizer.load_state_dict` keeps tensors that are already on the right device and
        dtype as they are: training would otherwise update the kept state in place, before it is accepted.
        """
        saved = self._states.get(key)
        return None if saved is None else cpu_copy(saved)

    def accept(self, key: StateKey, lease_id: int, state: dict[str, Any]) -> None:
        """Keep `state` (copied to CPU) for `key`: the coordinator accepted the work of lease `lease_id`."""
        self._states[key] = cpu_copy(state)
        self._states.move_to_end(key)
        self.last_lease = lease_id
        while len(self._states) > self.capacity:
            self._states.popitem(last=False)
