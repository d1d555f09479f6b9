"""Prometheus metrics, one registry per app (so tests and replicas never share counters).

Counters are per process, as usual for Prometheus: sum them over coordinator replicas in queries.
`dipaco_active_islands` is read from the database at scrape time, so every replica reports the same value.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from coordinator.errors import ServiceError

BYTES_IN_KINDS = ("outer_gradient", "shard")
"""`kind` labels of `dipaco_bytes_in_total`: request bodies of outer-gradient uploads, of shard registrations."""
BYTES_OUT_KINDS = ("weights", "shard")
"""`kind` labels of `dipaco_bytes_out_total`: module weights and shard (and held-out) tokens sent."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rounds_applied = Counter(
            "dipaco_rounds_applied",
            "Rounds whose last module step an apply executor of this process committed",
            registry=self.registry,
        )
        self.rounds_closed = Counter(
            "dipaco_rounds_closed", "Rounds this process closed (handed to the apply executors)", registry=self.registry
        )
        self.contributions = Counter(
            "dipaco_contributions",
            "Outer-gradient uploads by result (accepted, duplicate, or the rejection reason)",
            ["result"],
            registry=self.registry,
        )
        self.outliers = Counter(
            "dipaco_outer_gradient_outliers",
            "Module parts of accepted uploads the round apply clipped to the bound or refused (outer.max_norm, "
            "outer.max_norm_ratio, non-finite steps)",
            ["action"],
            registry=self.registry,
        )
        self.refused_requests = Counter(
            "dipaco_refused_requests",
            "Requests answered at the door, before any body was read: by reason (unauthorized, forbidden, "
            "payloadtoolarge)",
            ["reason"],
            registry=self.registry,
        )
        self.bytes_in = Counter(
            "dipaco_bytes_in",
            "Request body bytes this process received, by kind (outer_gradient, shard); direct transfers to the "
            "bucket never pass here",
            ["kind"],
            registry=self.registry,
        )
        self.bytes_out = Counter(
            "dipaco_bytes_out",
            "Bytes this process sent, by kind (weights, shard); direct transfers from the bucket never pass here",
            ["kind"],
            registry=self.registry,
        )
        # every kind shown from the start, at 0 until bytes pass (with direct transfers, outer gradients never do)
        for kind in BYTES_IN_KINDS:
            self.bytes_in.labels(kind=kind)
        for kind in BYTES_OUT_KINDS:
            self.bytes_out.labels(kind=kind)
        self.leases_issued = Counter("dipaco_leases_issued", "Leases handed to islands", registry=self.registry)
        self.lease_expiries = Counter(
            "dipaco_lease_expiries", "Leases that expired without an upload", registry=self.registry
        )
        self.active_islands = Gauge(
            "dipaco_active_islands", "Islands that heartbeated within 3 heartbeat intervals", registry=self.registry
        )

    @contextmanager
    def counting_refused_uploads(self) -> Iterator[None]:
        """Count an upload refused inside the block by its error class (`invalid`, `conflict`, ...)."""
        try:
            yield
        except ServiceError as exc:
            self.contributions.labels(result=type(exc).__name__.lower()).inc()
            raise


def counted(chunks: Iterable[bytes], counter: Any) -> Iterator[bytes]:
    """`chunks` as they are sent, each one added to `counter` (bytes out of a streamed reply)."""
    for chunk in chunks:
        counter.inc(len(chunk))
        yield chunk
