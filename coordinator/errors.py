"""Service errors; the API maps each to one HTTP status with `{"detail": message}`."""

from __future__ import annotations


class ServiceError(Exception):
    status_code = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthorized(ServiceError):
    status_code = 401


class Forbidden(ServiceError):
    status_code = 403


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class LeaseSpent(Conflict):
    """409 for an upload its lease can never deliver (its round closed, its run moved on, or its modules took
    more steps than the run allows since it started): the lease is retired so its island may take new work."""


class PayloadTooLarge(ServiceError):
    status_code = 413


class Invalid(ServiceError):
    status_code = 422
