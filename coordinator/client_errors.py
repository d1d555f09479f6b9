"""What `coordinator.client.CoordinatorClient` raises: low-level httpx errors, unexpected replies and hash
mismatches become these at the client boundary (`raise ... from exc`). Imports only the standard library.

    ClientError
    ├── CoordinatorUnavailable   no useful answer within the retry budget (connection errors, timeouts, 5xx, 429)
    ├── RequestRejected          a non-retryable 4xx: bad input or a bug on our side; carries the server's detail
    ├── LeaseLost                409 on an upload: the round closed or the lease is no longer active
    ├── IntegrityError           downloaded (or cached) bytes do not hash to the sha256 they are addressed by
    └── BadResponse              a 2xx whose body does not match the wire schema (version skew, a proxy's page)
"""

from __future__ import annotations

__all__ = ["BadResponse", "ClientError", "CoordinatorUnavailable", "IntegrityError", "LeaseLost", "RequestRejected"]


class ClientError(Exception):
    """Base class of every error the coordinator client raises."""


class CoordinatorUnavailable(ClientError):
    """No useful answer within the retry budget (connection errors, timeouts, 5xx, 429)."""

    def __init__(self, *, what: str, attempts: int, elapsed_s: float, last_error: str, base_url: str = "") -> None:
        self.what = what
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.last_error = last_error
        self.base_url = base_url
        where = f" at {base_url}" if base_url else ""
        super().__init__(
            f"coordinator{where} unavailable: {what} failed {attempts} time(s) over {elapsed_s:.1f}s; "
            f"last error: {last_error}"
        )


class RequestRejected(ClientError):
    """The coordinator answered with a non-retryable 4xx: a bug or bad input on our side."""

    def __init__(self, status: int, detail: str, *, what: str = "request") -> None:
        self.status = status
        self.detail = detail
        self.what = what
        super().__init__(f"{what} rejected with HTTP {status}: {detail}")


class LeaseLost(ClientError):
    """The lease is no longer active (expired, closed round: 409 on upload): discard its work.

    Not a `RequestRejected`: losing a lease is part of the protocol (a round may close without us), not a bug."""

    def __init__(self, lease_id: int, reason: str) -> None:
        self.lease_id = lease_id
        self.reason = reason
        super().__init__(f"lease {lease_id} lost: {reason}")


class IntegrityError(ClientError):
    """Downloaded or cached bytes do not hash to the sha256 they are addressed by."""

    def __init__(self, *, what: str, expected: str, actual: str) -> None:
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(f"{what}: sha256 mismatch, expected {expected}, got {actual}")


class BadResponse(ClientError):
    """A success status whose body is not what the wire schema says (another version, a proxy's error page)."""

    def __init__(self, *, what: str, problem: str) -> None:
        self.what = what
        self.problem = problem
        super().__init__(f"{what}: unexpected answer from the coordinator: {problem}")
