"""The error answers of the API, declared once for the OpenAPI document: every error is `{"detail": ...}`.

Every `/v1/` operation can answer 401 (no or unknown token: `api/guard.py`), 413 (a body over its cap) and 422
(a value out of range); `V1_ERRORS` is declared on each router, and each operation adds the codes only it gives
(`errors(403, 404, ...)`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    detail: str | list[dict[str, Any]] = Field(
        description="What was wrong, naming the offending value; request validation errors list each field"
    )


_WHY = {
    400: "A body that cannot be parsed as the JSON the operation takes",
    401: "No bearer token, an unknown one, or one that was revoked",
    403: "The token's scope may not do this (admin, join, island), or the island may not touch this object",
    404: "An id that does not exist",
    409: "The state does not allow it now (a closed round, a released lease, a name in use, ...)",
    413: "A body over its size cap",
    422: "A value out of range or malformed (path, query, header or body)",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error codes."""
    return {code: {"model": ErrorBody, "description": _WHY[code]} for code in codes}


V1_ERRORS = errors(401, 413, 422)
"""What any `/v1/` operation may answer."""
