"""Bearer tokens in three scopes: admin (create runs, register shards, revoke islands), join (register an
island) and island (its own heartbeats, leases and uploads). Every token is stored only as its sha256."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.errors import Forbidden, Unauthorized
from coordinator.models import Island
from coordinator.settings import MIN_TOKEN_CHARS, Settings
from coordinator.states import IslandStatus

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


class TokenFileError(RuntimeError):
    """`tokens.json` cannot be used: unreadable, not an object of strings, or a token too short."""


def load_service_tokens(settings: Settings) -> ServiceTokens:
    """Admin and join tokens from settings, else from <data_dir>/tokens.json, generated on first start.

    The file is written 0600 (and put back to 0600, with a warning, if it was opened up); its tokens obey the
    same minimum length as the environment's. A data directory this creates is 0700; an existing one that others
    can read gets a warning (it holds the tokens, the registry and the blobs).
    """
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    join = settings.join_token.get_secret_value() if settings.join_token else None
    path: Path | None = None
    if admin is None or join is None:
        path = (settings.data_dir / "tokens.json").resolve()
        ensure_private_dir(path.parent)
        stored = _read_token_file(path)
        missing = [key for key in ("admin_token", "join_token") if key not in stored]
        for key in missing:
            stored[key] = new_token(key.split("_")[0])
        if missing:
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # O_CREAT's mode only applies to a file it creates
            with os.fdopen(fd, "w") as f:
                json.dump(stored, f, indent=2)
            os.replace(tmp, path)
        elif path.stat().st_mode & 0o077:
            log.warning("%s was readable by others (mode %o); set it back to 0600", path, path.stat().st_mode & 0o777)
            path.chmod(0o600)
        admin = admin or stored["admin_token"]
        join = join or stored["join_token"]
    return ServiceTokens(admin_hash=hash_token(admin), join_hash=hash_token(join), generated_file=path)


def ensure_private_dir(directory: Path) -> None:
    """Create `directory` 0700 (parents as usual); warn when an existing one is open to others."""
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o700)
        directory.chmod(0o700)  # mkdir's mode is masked by the umask
    elif directory.stat().st_mode & 0o077:
        log.warning(
            "data directory %s is open to other users (mode %o): it holds the tokens, the registry and the blobs; "
            "consider chmod 700",
            directory,
            directory.stat().st_mode & 0o777,
        )


def _read_token_file(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenFileError(f"cannot read the tokens in {path}: {exc}") from exc
    if not isinstance(stored, dict) or not all(isinstance(v, str) for v in stored.values()):
        raise TokenFileError(f"{path} must be a JSON object of token strings")
    for key in ("admin_token", "join_token"):
        if key in stored and len(stored[key]) < MIN_TOKEN_CHARS:
            raise TokenFileError(f"{path}: {key} must be at least {MIN_TOKEN_CHARS} characters")
    return dict(stored)


@dataclass(frozen=True, slots=True)
class Principal:
    scope: Scope
    island_id: int | None = None


def token_digest(authorization: str | None) -> str:
    """The sha256 of the bearer token in an Authorization header (401 when there is none)."""
    if not authorization:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    kind, _, token = authorization.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
    return hash_token(token.strip())


class IslandTokenCache:
    """Island tokens found valid in the database within the last `ttl_s` seconds: digest -> island id.

    Heartbeats, lease requests and uploads then authenticate without a database round trip. A leave or revoke
    served by this process forgets the island at once; one served by another worker or replica on the same
    database takes effect here within `ttl_s`. `ttl_s` = 0 disables the cache.
    """

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._seen: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def get(self, digest: str) -> int | None:
        hit = self._seen.get(digest)
        if hit is None or hit[1] < self._clock():
            return None
        return hit[0]

    def put(self, digest: str, island_id: int) -> None:
        if self.ttl_s <= 0:
            return
        now = self._clock()
        with self._lock:
            if len(self._seen) >= 4096:  # islands that left or went quiet: drop what has run out
                self._seen = {d: hit for d, hit in self._seen.items() if hit[1] >= now}
            self._seen[digest] = (island_id, now + self.ttl_s)

    def forget(self, island_id: int) -> None:
        with self._lock:
            self._seen = {d: hit for d, hit in self._seen.items() if hit[0] != island_id}


def known_principal(digest: str, tokens: ServiceTokens, cache: IslandTokenCache | None) -> Principal | None:
    """The principal of a service token or of a cached island token; None when the database must be asked."""
    if hmac.compare_digest(digest, tokens.admin_hash):
        return Principal(scope="admin")
    if hmac.compare_digest(digest, tokens.join_hash):
        return Principal(scope="join")
    island_id = cache.get(digest) if cache is not None else None
    return None if island_id is None else Principal(scope="island", island_id=island_id)


def authenticate(
    session: Session, tokens: ServiceTokens, authorization: str | None, cache: IslandTokenCache | None = None
) -> Principal:
    digest = token_digest(authorization)
    known = known_principal(digest, tokens, cache)
    if known is not None:
        return known
    row = session.execute(select(Island.id, Island.status).where(Island.token_hash == digest)).first()
    if row is None:
        raise Unauthorized("unknown token")
    island_id, status = row
    if status == IslandStatus.REVOKED:
        raise Unauthorized(f"island {island_id}'s token was revoked")
    if status == IslandStatus.LEFT:
        raise Unauthorized(f"island {island_id} has left; join again for a new token")
    if cache is not None:
        cache.put(digest, island_id)
    return Principal(scope="island", island_id=island_id)


def require(principal: Principal, *scopes: Scope) -> None:
    if principal.scope not in scopes:
        raise Forbidden(f"this needs a token of scope {' or '.join(scopes)}, got one of scope {principal.scope}")


def require_island(principal: Principal, island_id: int) -> None:
    require(principal, "island")
    if principal.island_id != island_id:
        raise Forbidden(f"this token belongs to island {principal.island_id}, not island {island_id}")
