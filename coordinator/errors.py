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


class PayloadTooLarge(ServiceError):
    status_code = 413


class Invalid(ServiceError):
    status_code = 422
