"""`dipaco registry create-run` and `dipaco registry islands` through the real app (the command's client talks
through the app's TestClient, `ctx.obj`), and `dipaco coordinator tokens`."""

from __future__ import annotations

import json
import shlex
import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from coordinator.client import CoordinatorClient, RetryPolicy
from dipaco.cli import app
from tests.conftest import ADMIN, JOIN
from tests.coordinator.helpers import TINY_RUN
from tests.coordinator.test_client import running_run

runner = CliRunner()


def admin(client: TestClient) -> CoordinatorClient:
    return CoordinatorClient("http://testserver", ADMIN, http=client, retry=RetryPolicy.once())


def test_create_run_from_a_spec_file_and_flags(client: TestClient, tmp_path: Path) -> None:
    spec = tmp_path / "run.json"
    spec.write_text(json.dumps({**TINY_RUN, "name": "from-file"}))
    args = ["registry", "create-run", "--spec", str(spec), "--rounds", "7", "--token", ADMIN]
    result = runner.invoke(app, args, obj=client)
    assert result.exit_code == 0, result.output
    assert "run 1 'from-file': 4 paths (embed:shared, b0-0:routed2, b1-1:routed2, head:shared), 7 rounds" in (
        result.output
    )
    assert "dipaco router register --run 1" in result.output
    (run,) = admin(client).runs()
    assert (run.name, run.num_rounds, run.inner_steps, run.config["model"]["d_model"]) == ("from-file", 7, 2, 32)

    yaml_spec = tmp_path / "run.yaml"
    yaml_spec.write_text("name: from-yaml\nmodel: {flavour: debug, d_model: 32, n_heads: 2}\nnum_rounds: 2\n")
    flags = ["--inner-steps", "3", "--batch-size", "2", "--block", "gpt2", "--json"]
    result = runner.invoke(
        app, ["registry", "create-run", "--spec", str(yaml_spec), *flags, "--token", ADMIN], obj=client
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert (body["name"], body["inner_steps"], body["config"]["model"]["block"]) == ("from-yaml", 3, "gpt2")
    assert body["config"]["inner"]["batch_size"] == 2


def test_create_run_from_flags_only(client: TestClient) -> None:
    args = ["registry", "create-run", "--name", "flags", "--flavour", "debug", "--inner-steps", "5", "--rounds", "2"]
    result = runner.invoke(app, [*args, "--token", ADMIN, "--wait", "5"], obj=client)
    assert result.exit_code == 0, result.output
    (run,) = admin(client).runs()
    assert (run.name, run.inner_steps, run.num_rounds, run.num_paths) == ("flags", 5, 2, 4)


def test_create_run_refuses_a_bad_spec_or_token_before_creating(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "r", "inner_step": 3}))
    result = runner.invoke(app, ["registry", "create-run", "--spec", str(bad), "--token", ADMIN], obj=client)
    assert result.exit_code == 1 and "run spec: inner_step: Extra inputs are not permitted" in result.output
    result = runner.invoke(app, ["registry", "create-run", "--token", ADMIN], obj=client)
    assert result.exit_code == 1 and "name: Field required" in result.output
    result = runner.invoke(app, ["registry", "create-run", "--name", "r", "--token", JOIN], obj=client)
    assert result.exit_code == 1 and "HTTP 403" in result.output
    monkeypatch.delenv("DIPACO_ADMIN_TOKEN", raising=False)
    result = runner.invoke(app, ["registry", "create-run", "--name", "r"], obj=client)
    assert result.exit_code == 1 and "no admin token: pass --token or set DIPACO_ADMIN_TOKEN" in result.output
    assert admin(client).runs() == []


def test_islands_show_their_current_lease(client: TestClient, tmp_path: Path) -> None:
    run_id = running_run(admin(client), tmp_path)
    island = CoordinatorClient("http://testserver", JOIN, http=client, retry=RetryPolicy.once())
    island.join("busy")
    lease = island.lease()
    assert lease is not None
    CoordinatorClient("http://testserver", JOIN, http=client, retry=RetryPolicy.once()).join("idle")
    result = runner.invoke(app, ["registry", "islands", "--token", JOIN], obj=client)  # any valid token reads
    assert result.exit_code == 0, result.output
    busy = next(line for line in result.output.splitlines() if "busy" in line)
    assert f"run {run_id} round 0 path {lease.path_index}" in busy
    idle = next(line for line in result.output.splitlines() if "idle" in line)
    assert "run " not in idle
    result = runner.invoke(app, ["registry", "islands", "--json", "--token", ADMIN], obj=client)
    rows = {row["name"]: row for row in json.loads(result.stdout)["data"]}
    assert rows["busy"]["leases"] == [
        {"id": lease.lease_id, "run_id": run_id, "round": 0, "path_index": lease.path_index, "shared": False}
    ]
    assert rows["idle"]["leases"] == [] and "lease" not in rows["idle"]


def test_tables_are_not_cut_when_stdout_is_not_a_terminal(client: TestClient) -> None:
    layout = "embed:shared, b0-0:routed2, b1-1:routed2, head:shared"
    admin(client).create_run({**TINY_RUN, "name": "a-run-name-long-enough-to-be-cut-at-eighty-columns"})
    result = runner.invoke(app, ["registry", "runs", "--token", ADMIN], obj=client, env={"COLUMNS": ""})
    assert result.exit_code == 0, result.output
    assert layout in result.output and "a-run-name-long-enough-to-be-cut-at-eighty-columns" in result.output
    assert "…" not in result.output


def test_tokens_command_creates_prints_and_exports(tmp_path: Path) -> None:
    data = tmp_path / "data"
    result = runner.invoke(app, ["coordinator", "tokens", "--data-dir", str(data)])
    assert result.exit_code == 0, result.output
    stored = json.loads((data / "tokens.json").read_text())
    assert stat.S_IMODE((data / "tokens.json").stat().st_mode) == 0o600
    assert stored["admin_token"] in result.stdout and stored["join_token"] in result.stdout
    assert "created" in result.stderr
    again = runner.invoke(app, ["coordinator", "tokens", "--export"], env={"DIPACO_DATA_DIR": str(data)})
    assert again.exit_code == 0 and "created" not in again.stderr
    words = shlex.split(again.stdout)
    assert words[0] == "export" and dict(w.split("=", 1) for w in words[1:]) == {
        "DIPACO_ADMIN_TOKEN": stored["admin_token"],
        "DIPACO_JOIN_TOKEN": stored["join_token"],
    }
    (data / "tokens.json").write_text("{}")
    broken = runner.invoke(app, ["coordinator", "tokens", "--data-dir", str(data)])
    assert broken.exit_code == 1 and "cannot read the tokens" in broken.output
