"""The `island` Typer app and the package's public surface."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
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


def test_more_cuda_processes_than_gpus_is_a_usage_error_before_any_follower_starts(tmp_path: Path) -> None:
    """`--nproc N --device cuda` needs N GPUs (NCCL refuses two ranks on one); without CUDA it is the device that
    is refused. Either way exit 2, naming the option, and no follower process is started."""
    nproc = torch.cuda.device_count() + 1
    args = ["join", "--coordinator", "http://127.0.0.1:9", "--token", "t", "--cache-dir", str(tmp_path)]
    result = runner.invoke(app, [*args, "--device", "cuda", "--nproc", str(max(nproc, 2))])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.replace("│", " ").split())  # rich wraps the message inside a box
    if torch.cuda.is_available():
        assert "--nproc" in said and f"this machine has {nproc - 1};" in said, said
    else:
        assert "--device" in said and "CUDA is not available" in said, said
    assert "WORLD_SIZE" not in os.environ  # launch_followers never ran (it sets WORLD_SIZE)
