"""`dipaco registry create-run`, `islands`, `modules` and `contributions` through the real app (the command's
client talks through the app's TestClient, `ctx.obj`), and `dipaco coordinator tokens`."""

from __future__ import annotations

import json
import shlex
import stat
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from coordinator.client import CoordinatorClient, RetryPolicy
from dipaco.cli import app
from tests.conftest import ADMIN, JOIN, FakeClock
from tests.coordinator.helpers import TINY_RUN, app_executor, create_running_run, join, lease, train_lease, upload
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


def _table(output: str) -> list[dict[str, str]]:
    """The rows of the one Rich table in `output`, as {column: cell}."""
    lines = output.splitlines()
    header = [cell.strip() for cell in next(line for line in lines if line.startswith("┃")).strip("┃").split("┃")]
    return [
        dict(zip(header, (cell.strip() for cell in line.strip("│").split("│")), strict=True))
        for line in lines
        if line.startswith("│")
    ]


def _stale_async_run(client: TestClient, clock: FakeClock) -> tuple[int, dict[tuple[int, int], int]]:
    """An all-async run where the routed module paths 0 and 1 share (b0 index 0) took one step: path 0's second
    upload trained from its version 0 (staleness 1), path 1's second from its version 1 (staleness 0). The run's
    id and its module ids by (level, index)."""
    run = create_running_run(client, name="async", sync="async", inner_steps=2, num_rounds=2)
    islands = [join(client, f"island-{p}") for p in range(2)]

    def train(body: dict[str, Any] | None, headers: dict[str, str]) -> None:
        assert body is not None
        tokens = body["inner_steps"] * body["inner"]["batch_size"] * body["model"]["seq_len"]
        r = upload(client, body, headers, train_lease(client, body, headers), tokens=tokens)
        assert r.status_code == 200, r.text

    first = [lease(client, i, h) for i, h in islands]
    train(first[0], islands[0][1])
    stale = lease(client, *islands[0])  # from b0's version 0
    train(first[1], islands[1][1])  # fills the period of b0 index 0 (its 2 users)
    assert app_executor(client, clock).work() == 1
    fresh = lease(client, *islands[1])  # from b0's version 1
    train(stale, islands[0][1])
    train(fresh, islands[1][1])
    modules = {(m.level, m.index): m.id for m in admin(client).modules(run_id=run["id"])}
    return run["id"], modules


def test_modules_show_each_ones_mode_and_version(no_executors: TestClient, clock: FakeClock) -> None:
    client = no_executors
    run_id, ids = _stale_async_run(client, clock)
    other = admin(client).create_run({**TINY_RUN, "name": "round-run"}).id  # round levels, nothing trained
    result = runner.invoke(app, ["registry", "modules", "--token", ADMIN], obj=client)
    assert result.exit_code == 0, result.output
    shown = {
        (row["run_id"], row["level"], row["index"]): (row["mode"], row["version"]) for row in _table(result.output)
    }
    b0 = ("1", "0")
    assert shown.pop((str(run_id), *b0)) == ("async", "1")  # the one module that stepped
    assert shown == {
        **{(str(run_id), str(lv), str(i)): ("async", "0") for lv, i in ids if (str(lv), str(i)) != b0},
        **{(str(other), str(lv), str(i)): ("round", "0") for lv, i in ids},
    }
    result = runner.invoke(
        app, ["registry", "modules", "--run-id", str(run_id), "--json", "--token", ADMIN], obj=client
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["count"] == 6
    assert {(m["level"], m["index"]): (m["id"], m["mode"], m["version"]) for m in body["data"]} == {
        key: (module_id, "async", 1 if key == (1, 0) else 0) for key, module_id in ids.items()
    }


def test_contributions_show_base_versions_and_staleness(no_executors: TestClient, clock: FakeClock) -> None:
    client = no_executors
    run_id, ids = _stale_async_run(client, clock)
    embed, b0_0, b1_0, b1_1, head = (ids[k] for k in ((0, 0), (1, 0), (2, 0), (2, 1), (3, 0)))
    result = runner.invoke(app, ["registry", "contributions", "--run-id", str(run_id), "--token", ADMIN], obj=client)
    assert result.exit_code == 0, result.output
    shown = {
        (row["path_index"], row["round"]): (row["base_versions"], row["staleness"]) for row in _table(result.output)
    }
    # paths 0 and 1 use b0 index 0, and b1 index 0 and 1 (paths pick (b0, b1) = (0, 0), (0, 1), ...)
    assert shown == {
        ("0", "0"): (f"{embed}:v0 {b0_0}:v0 {b1_0}:v0 {head}:v0", f"{embed}:0 {b0_0}:0 {b1_0}:0 {head}:0"),
        ("1", "0"): (f"{embed}:v0 {b0_0}:v0 {b1_1}:v0 {head}:v0", f"{embed}:0 {b0_0}:0 {b1_1}:0 {head}:0"),
        ("0", "1"): (f"{embed}:v0 {b0_0}:v0 {b1_0}:v0 {head}:v0", f"{embed}:0 {b0_0}:1 {b1_0}:0 {head}:0"),
        ("1", "1"): (f"{embed}:v0 {b0_0}:v1 {b1_1}:v0 {head}:v0", f"{embed}:0 {b0_0}:0 {b1_1}:0 {head}:0"),
    }
    result = runner.invoke(
        app,
        ["registry", "contributions", "--run-id", str(run_id), "--round", "1", "--json", "--token", ADMIN],
        obj=client,
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["count"] == 2 and "base_versions" not in body["data"][0]  # the table's rendering only
    parts = {
        c["path_index"]: [(m["module_id"], m["base_version"], m["staleness"]) for m in c["modules"]]
        for c in body["data"]
    }
    assert parts == {
        0: [(embed, 0, 0), (b0_0, 0, 1), (b1_0, 0, 0), (head, 0, 0)],
        1: [(embed, 0, 0), (b0_0, 1, 0), (b1_1, 0, 0), (head, 0, 0)],
    }
