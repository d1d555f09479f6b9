from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from router.cli import app

runner = CliRunner()


def test_public_commands() -> None:
    # data only: `register` and `refit` talk to the coordinator and join the group in dipaco.cli
    names = sorted(c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands)
    assert names == ["corpus", "shard"]


def test_corpus_and_shard_commands(tmp_path: Path) -> None:
    result = runner.invoke(app, ["corpus", "--out", str(tmp_path / "c"), "--max-docs-per-domain", "12"])
    assert result.exit_code == 0, result.output
    assert "train docs" in result.output and "total" in result.output
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    for domain in manifest["domains"]:
        assert domain in result.output

    result = runner.invoke(
        app,
        [
            "shard",
            "--corpus",
            str(tmp_path / "c"),
            "--out",
            str(tmp_path / "s"),
            "--paths",
            "2",
            "--prefix-tokens",
            "24",
            "--seed",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "purity" in result.output and "random assignment" in result.output
    shards = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert (shards["num_paths"], shards["prefix_tokens"], shards["seed"]) == (2, 24, 3)


def test_shard_without_corpus_fails_cleanly(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["shard", "--corpus", str(tmp_path / "none"), "--out", str(tmp_path / "s"), "--paths", "2"]
    )
    assert result.exit_code == 1
    assert "no corpus manifest" in result.output
