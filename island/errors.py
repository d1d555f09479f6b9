"""The island's exception hierarchy: low-level httpx / IO errors become these at the client boundary."""

from __future__ import annotations


class IslandError(Exception):
    """Base class of every error the island raises on purpose."""


class CoordinatorUnavailable(IslandError):
    """No useful answer within the retry budget (connection errors, timeouts, 5xx, 429)."""

    def __init__(self, *, what: str, attempts: int, elapsed_s: float, last_error: str) -> None:
        self.what = what
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.last_error = last_error
        super().__init__(
            f"coordinator unavailable: {what} failed {attempts} time(s) over {elapsed_s:.1f}s; last error: {last_error}"
        )


class LeaseLost(IslandError):
    """The lease is no longer active (expired, closed round, 409 on upload): discard its work."""

    def __init__(self, lease_id: int, reason: str) -> None:
        self.lease_id = lease_id
        self.reason = reason
        super().__init__(f"lease {lease_id} lost: {reason}")


class RequestRejected(IslandError):
    """The coordinator answered with a non-retryable 4xx: a bug or bad input on our side."""

    def __init__(self, status: int, detail: str, *, what: str = "request") -> None:
        self.status = status
        self.detail = detail
        self.what = what
        super().__init__(f"{what} rejected with HTTP {status}: {detail}")


class IntegrityError(IslandError):
    """Downloaded or cached bytes do not hash to the sha256 they are addressed by."""

    def __init__(self, *, what: str, expected: str, actual: str) -> None:
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(f"{what}: sha256 mismatch, expected {expected}, got {actual}")
