"""The `island` Typer app and the package's public surface."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

import island
from island.cli import app
from island.worker import EXIT_UNAVAILABLE

runner = CliRunner()


def test_public_surface_is_pinned() -> None:
    assert sorted(island.__all__) == [
        "BlobCache",
        "ClientError",
        "CoordinatorClient",
        "CoordinatorUnavailable",
        "IntegrityError",
        "Island",
        "IslandConfig",
        "IslandError",
        "LeaseLost",
        "RequestRejected",
        "RetryPolicy",
    ]
    group = get_command(app)
    assert sorted(group.commands) == ["join"]  # type: ignore[attr-defined]
    options = {opt for param in group.commands["join"].params for opt in param.opts}  # type: ignore[attr-defined]
    assert {
        "--coordinator",
        "--token",
        "--device",
        "--name",
        "--site",
        "--cache-dir",
        "--max-rounds",
        "--exit-when-idle",
        "--give-up-after",
        "--quiet",
    } <= options


def test_join_without_a_token_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIPACO_JOIN_TOKEN", raising=False)
    result = runner.invoke(app, ["join", "--coordinator", "http://127.0.0.1:9"])
    assert result.exit_code == 2


def test_bad_device_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "join",
            "--coordinator",
            "http://127.0.0.1:9",
            "--token",
            "t",
            "--device",
            "tpu",
            "--cache-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 2
    assert "device" in result.output


def test_env_fallbacks_and_unreachable_coordinator_exit_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Port 9 (discard) on loopback: connection refused at once; a zero retry budget gives up after one try.
    monkeypatch.setenv("DIPACO_COORDINATOR", "http://127.0.0.1:9")
    monkeypatch.setenv("DIPACO_JOIN_TOKEN", "join-token")
    result = runner.invoke(
        app, ["join", "--cache-dir", str(tmp_path), "--give-up-after", "0", "--quiet", "--device", "cpu"]
    )
    assert result.exit_code == EXIT_UNAVAILABLE, result.output
