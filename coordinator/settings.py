"""Coordinator settings: one pydantic-settings class, environment prefix `DIPACO_`.

Timeouts, and how they relate (by their defaults; nothing checks a run's TTL against the interval):
  island HTTP request timeout (60 s, island side) < heartbeat interval * 3 <= run's lease TTL (default 120 s).
The heartbeat interval is the coordinator's; each run has its own lease TTL (RunCreate.lease_ttl_s).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_TOKEN_CHARS = 16
"""Shortest admin or join token accepted, from the environment or from tokens.json."""


def redact_url(url: str) -> str:
    """A database or blob URL fit to print or log: any password replaced by `***`."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url  # not a database URL (a path, s3://bucket/prefix): no password in it
    return parsed.render_as_string(hide_password=True) if parsed.password else url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DIPACO_", extra="ignore")

    data_dir: Path = Field(default=Path(".dipaco"), description="Holds the SQLite file, blobs and tokens.json")
    database_url: str | None = Field(default=None, description="Default: sqlite:///<data_dir>/dipaco.db")
    blob_url: str | None = Field(
        default=None, description="A directory, file:///path or s3://bucket/prefix; default <data_dir>/blobs"
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, Ceph, ...); credentials from the usual AWS_* env"
    )
    admin_token: SecretStr | None = Field(default=None, description="Generated on first start if unset")
    join_token: SecretStr | None = Field(default=None, description="Generated on first start if unset")
    metrics_token: SecretStr | None = Field(
        default=None, description="When set, GET /metrics needs it as a bearer token (default: open to scrapers)"
    )
    path_reservation_s: float = Field(
        default=10.0,
        ge=0,
        description="After a round opens, a path stays reserved this long for the live island that trained it last",
    )
    db_pool_size: int = Field(default=20, ge=1, description="Database connections kept open per process")
    db_max_overflow: int = Field(default=20, ge=0, description="Extra connections per process under load")
    migrate_on_start: bool = Field(default=True, description="Run `alembic upgrade head` on start-up")
    heartbeat_interval_s: float = Field(default=10.0, gt=0, description="Islands heartbeat this often")
    sweep_interval_s: float = Field(
        default=1.0, gt=0, description="Background pass that expires leases and closes rounds past their deadline"
    )
    staging_sweep_s: float = Field(
        default=600.0,
        ge=0,
        description="How often the coordinator removes staged uploads nothing will read (a crash between staging and "
        "commit, a direct PUT never committed); the first pass at start-up; 0: never",
    )
    staging_grace_s: float = Field(
        default=3600.0,
        gt=0,
        description="Only staged uploads written longer ago than this are removed, and never one of a pending lease",
    )
    auth_cache_s: float = Field(
        default=30.0,
        ge=0,
        description="An island token found valid is trusted this long without a database lookup; a revoke served "
        "by another worker or replica takes effect within it (0: look up every request)",
    )
    fault_pause_at: str | None = Field(default=None, description="Crash tests only: see coordinator/faults.py")
    max_upload_bytes: int = Field(default=1 << 30, gt=0, description="Cap on one outer-gradient upload")
    upload_stream_check_bytes: int = Field(
        default=4 << 20,
        ge=0,
        description="Outer-gradient uploads announcing at least this many bytes have their values checked while "
        "they stream in, instead of read back from the spooled file, and the sha256 they name "
        "(X-Dipaco-Content-Sha256) checked by the apply executor, instead of hashed on the request (0: every upload)",
    )
    spool_direct: bool = Field(
        default=True,
        description="Write upload bodies of over a MiB to the spool directory past the page cache (O_DIRECT) where "
        "its filesystem allows it (measured faster here, docs/LOG.md); false: through the page cache",
    )
    max_path_params: int = Field(
        default=500_000_000,
        gt=0,
        description="Largest model a run may ask for, in parameters per path (creating a run initialises one path "
        "in the coordinator's memory)",
    )
    max_leases_per_island: int = Field(
        default=4,
        ge=1,
        description="Most leases one island holds at once, however many its capabilities claim (default 1 each)",
    )
    apply_workers: int = Field(
        default=1,
        ge=0,
        le=64,
        description="Apply executors (threads) this process runs; 0: only external `coordinator apply-worker`s",
    )
    torch_threads: int = Field(
        default=1,
        ge=1,
        le=256,
        description="torch intra-op threads of a coordinator or apply-worker process (the apply math); add executors, "
        "not threads: two threads per process made the same apply 1x-10x slower at random on a shared 2-core box",
    )
    apply_claim_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="A module step claimed longer ago than this by an executor on another host is taken over",
    )
    presign_expiry_s: float = Field(
        default=900.0,
        gt=0,
        le=7 * 86_400,
        description="With an s3:// blob store: how long the pre-signed URLs of direct transfers are good for",
    )
    direct_multipart_bytes: int = Field(
        default=64 << 20,
        gt=0,
        description="With an s3:// blob store: a direct upload of at least this many bytes goes to the bucket in "
        "parts (an S3 multipart upload: one pre-signed URL per part), a smaller one in one PUT",
    )
    direct_part_bytes: int = Field(
        default=16 << 20,
        ge=5 << 20,
        le=5 << 30,
        description="Size of each part of a multipart direct upload but the last (S3: 5 MiB to 5 GiB; larger when "
        "the body would need more than 10,000 parts)",
    )
    max_json_bytes: int = Field(
        default=1 << 20, gt=0, description="Cap on a JSON request body (run specs, joins); larger ones get 413"
    )
    max_shard_bytes: int = Field(default=4 << 30, gt=0, description="Cap on one shard token file")

    @model_validator(mode="after")
    def _tokens_not_placeholders(self) -> Settings:
        for name in ("admin_token", "join_token"):
            value = getattr(self, name)
            if value is not None and len(value.get_secret_value()) < MIN_TOKEN_CHARS:
                raise ValueError(f"DIPACO_{name.upper()} must be at least {MIN_TOKEN_CHARS} characters")
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'dipaco.db').resolve()}"

    @property
    def resolved_blob_url(self) -> str:
        return self.blob_url or str((self.data_dir / "blobs").resolve())
