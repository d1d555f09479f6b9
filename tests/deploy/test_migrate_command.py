"""`dipaco coordinator migrate`: the one-shot schema step of compose and the Kubernetes Job, and `--check`, which
new coordinator replicas wait on. SQLite and PostgreSQL (two migrators at once on PostgreSQL: the advisory lock
in migrations/env.py makes them take turns)."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from coordinator.cli import app
from tests.deploy.helpers import ROOT

runner = CliRunner()


def _migrate(url: str, *extra: str) -> tuple[int, str]:
    result = runner.invoke(app, ["migrate", "--database-url", url, *extra])
    return result.exit_code, result.output


def test_migrate_then_check(database_url: str) -> None:
    code, out = _migrate(database_url, "--check")
    assert code == 1 and "no revision (empty schema), the code's head is" in out
    code, out = _migrate(database_url)
    assert code == 0 and "migrated from no revision (empty schema) to" in out
    code, out = _migrate(database_url, "--check")
    assert code == 0 and "is at head" in out
    code, out = _migrate(database_url)
    assert code == 0 and "was already at head" in out


def test_concurrent_migrations_apply_once(postgres_url: str) -> None:
    """Two migrators at once, as two processes (a Job and a replica, or two Jobs); both succeed."""
    code = "import sys; from coordinator.cli import app; app(sys.argv[1:])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, "migrate", "--database-url", postgres_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("migrated from no revision" in out for out in outputs) >= 1
    assert _migrate(postgres_url, "--check")[0] == 0


def test_unreachable_database_is_one_line_without_the_password() -> None:
    code, out = _migrate("postgresql+psycopg://dipaco:s3cret-pw@127.0.0.1:9/dipaco")
    assert code == 1
    assert "did not answer" in out and "s3cret-pw" not in out and "***" in out
