"""Bearer tokens in three scopes: admin (create runs, register shards, revoke islands), join (register an
island) and island (its own heartbeats, leases and uploads). Every token is stored only as its sha256."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.errors import Forbidden, Unauthorized
from coordinator.models import Island
from coordinator.settings import Settings

log = logging.getLogger(__name__)
Scope = Literal["admin", "join", "island"]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


@dataclass(frozen=True, slots=True)
class ServiceTokens:
    admin_hash: str
    join_hash: str
    generated_file: Path | None
    """Where generated tokens were written (None when both came from the environment)."""


def load_service_tokens(settings: Settings) -> ServiceTokens:
    """Admin and join tokens from settings, else from <data_dir>/tokens.json, generated on first start."""
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    join = settings.join_token.get_secret_value() if settings.join_token else None
    path: Path | None = None
    if admin is None or join is None:
        path = (settings.data_dir / "tokens.json").resolve()
        stored: dict[str, str] = {}
        if path.exists():
            stored = json.loads(path.read_text())
        changed = False
        for key in ("admin_token", "join_token"):
            if key not in stored:
                stored[key] = new_token(key.split("_")[0])
                changed = True
        if changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(stored, f, indent=2)
            os.replace(tmp, path)
        admin = admin or stored["admin_token"]
        join = join or stored["join_token"]
    return ServiceTokens(admin_hash=hash_token(admin), join_hash=hash_token(join), generated_file=path)


@dataclass(frozen=True, slots=True)
class Principal:
    scope: Scope
    island_id: int | None = None


def authenticate(session: Session, tokens: ServiceTokens, authorization: str | None) -> Principal:
    if not authorization:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    kind, _, token = authorization.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
    digest = hash_token(token.strip())
    if hmac.compare_digest(digest, tokens.admin_hash):
        return Principal(scope="admin")
    if hmac.compare_digest(digest, tokens.join_hash):
        return Principal(scope="join")
    row = session.execute(select(Island.id, Island.status).where(Island.token_hash == digest)).first()
    if row is None:
        raise Unauthorized("unknown token")
    island_id, status = row
    if status == "revoked":
        raise Unauthorized(f"island {island_id}'s token was revoked")
    if status == "left":
        raise Unauthorized(f"island {island_id} has left; join again for a new token")
    return Principal(scope="island", island_id=island_id)


def require(principal: Principal, *scopes: Scope) -> None:
    if principal.scope not in scopes:
        raise Forbidden(f"this needs a token of scope {' or '.join(scopes)}, got one of scope {principal.scope}")


def require_island(principal: Principal, island_id: int) -> None:
    require(principal, "island")
    if principal.island_id != island_id:
        raise Forbidden(f"this token belongs to island {principal.island_id}, not island {island_id}")
