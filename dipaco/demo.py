"""`dipaco demo`: the whole system on one machine, for real.

A coordinator (SQLite + local blob directory) runs as a subprocess; the built-in corpus is assembled and
routed into one shard per path; a 2x2 run is created; islands join as subprocesses over HTTP and train until
the run finishes. The demo prints per-round train loss per path and the module versions, stops everything and
says where the database and blobs were left.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

console = Console()
MARKER = ".dipaco-demo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prepare_workdir(workdir: Path) -> None:
    if workdir.exists():
        if not (workdir / MARKER).exists():
            raise typer.BadParameter(f"{workdir} exists and was not made by `dipaco demo`; pick another --workdir")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / MARKER).write_text("made by dipaco demo; removed and rebuilt by the next demo run\n")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}; see {log}:\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"coordinator did not answer /healthz within {timeout_s:.0f} s; see {log}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen[bytes], name: str, timeout_s: float = 15) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        console.print(f"[yellow]{name} did not stop within {timeout_s:.0f} s; killing it[/]")
        proc.kill()
        proc.wait()


def demo(
    workdir: Annotated[Path, typer.Option(help="Everything the demo writes goes here (rebuilt each run)")] = Path(
        "dipaco-demo"
    ),
    rounds: Annotated[int, typer.Option(min=1, help="Outer rounds")] = 5,
    inner_steps: Annotated[int, typer.Option(min=1, help="H: inner AdamW steps per round")] = 30,
    islands: Annotated[int, typer.Option(min=1, help="Island subprocesses")] = 2,
    flavour: Annotated[str, typer.Option(help="Model flavour: debug, small")] = "debug",
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    docs_per_domain: Annotated[int, typer.Option(min=10, help="Corpus size")] = 300,
) -> None:
    """Run everything on this machine: coordinator, corpus, router, a 2x2 run and island subprocesses."""
    from router.corpus import build_local_corpus
    from router.shards import shard_corpus

    started = time.monotonic()
    workdir = workdir.resolve()
    _prepare_workdir(workdir)
    logs = workdir / "logs"
    logs.mkdir()
    console.rule("[bold]dipaco demo")

    console.print("[bold]1/5[/] building the local corpus (Python, C headers, man pages, licences, changelogs)")
    manifest = build_local_corpus(workdir / "corpus", max_docs_per_domain=docs_per_domain)
    console.print(
        f"    {manifest['splits']['train']['documents']} train documents, "
        f"{manifest['splits']['heldout']['documents']} held-out"
    )

    console.print("[bold]2/5[/] routing documents by their first 32 tokens into 4 shards (k-means)")
    shards = shard_corpus(workdir / "corpus", workdir / "shards", num_paths=4)
    console.print(
        f"    shard purity by domain {shards['purity']:.2f} (random assignment {shards['purity_random']:.2f})"
    )

    admin, join = f"admin_{secrets.token_urlsafe(24)}", f"join_{secrets.token_urlsafe(24)}"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "DIPACO_ADMIN_TOKEN": admin,
        "DIPACO_JOIN_TOKEN": join,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    coord_dir = workdir / "coordinator"
    console.print(f"[bold]3/5[/] starting the coordinator on {url} (SQLite + blobs in {coord_dir})")
    coord_log = logs / "coordinator.log"
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    coord = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dipaco",
            "coordinator",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(coord_dir),
            "--log-level",
            "warning",
        ],
        stdout=coord_log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    procs.append(("coordinator", coord))
    ok = False
    try:
        _wait_healthy(url, coord, coord_log)
        client = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {admin}"})
        spec: dict[str, Any] = {
            "name": "demo-2x2",
            "model": {"flavour": flavour},
            "layout": "",
            "inner": {"batch_size": batch_size, "warmup_steps": min(10, inner_steps)},
            "inner_steps": inner_steps,
            "num_rounds": rounds,
            "lease_ttl_s": 60,
        }
        from modules import flavour as get_flavour
        from modules import grid_layout

        spec["layout"] = grid_layout(n_layers=get_flavour(flavour).n_layers, routed=[2, 2]).spec()
        r = client.post("/v1/runs", json=spec)
        if r.status_code != 201:
            raise RuntimeError(f"creating the run failed: {r.status_code} {r.text}")
        run = r.json()
        console.print(
            f"    run {run['id']} '{run['name']}': layout {run['layout']}, {run['num_paths']} paths, "
            f"{rounds} rounds x H={inner_steps}"
        )
        from router.cli import register_shards

        register_shards(workdir / "shards", client=client, run_id=run["id"])

        console.print(f"[bold]4/5[/] starting {islands} island(s) as subprocesses")
        for i in range(islands):
            log = logs / f"island-{i}.log"
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dipaco",
                    "island",
                    "join",
                    "--coordinator",
                    url,
                    "--token",
                    join,
                    "--name",
                    f"island-{i}",
                    "--site",
                    "demo",
                    "--cache-dir",
                    str(workdir / f"island-{i}"),
                    "--device",
                    "cpu",
                    "--quiet",
                ],
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                env=env,
            )
            procs.append((f"island-{i}", p))
        losses = _watch(client, run["id"], rounds, procs, logs)

        console.print("[bold]5/5[/] done; stopping islands and coordinator")
        for name, p in procs[1:]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _stop(p, name)
        _report(client, run["id"], losses)
        ok = True
    finally:
        for name, p in reversed(procs):
            _stop(p, name)
        if not ok:
            for name, _ in procs:
                console.print(f"[red]--- last lines of {name}'s log ({logs / (name + '.log')}) ---[/]")
                console.print(_tail(logs / f"{name}.log"), markup=False)
    console.print(f"database: {coord_dir / 'dipaco.db'}")
    console.print(f"blobs:    {coord_dir / 'blobs'}")
    console.print(f"logs:     {logs}")
    console.print(
        f"Inspect the registry again with:\n  DIPACO_ADMIN_TOKEN={admin} DIPACO_JOIN_TOKEN={join} "
        f"dipaco coordinator serve --data-dir {coord_dir} --port {port}\n"
        f"  DIPACO_TOKEN={admin} dipaco registry modules --coordinator {url}"
    )
    (workdir / "summary.json").write_text(json.dumps({"run_id": run["id"], "losses": losses}, indent=2))
    console.print(f"finished in {time.monotonic() - started:.0f} s")


def _watch(
    client: httpx.Client, run_id: int, rounds: int, procs: list[tuple[str, subprocess.Popen[bytes]]], logs: Path
) -> dict[int, dict[int, float]]:
    """Print each round as it is applied; returns {round: {path: train loss}}."""
    printed = 0
    losses: dict[int, dict[int, float]] = {}
    while True:
        run = client.get(f"/v1/runs/{run_id}").json()
        contribs = client.get("/v1/contributions", params={"run_id": run_id, "limit": 1000}).json()["data"]
        for c in contribs:
            losses.setdefault(c["round"], {})[c["path_index"]] = c["train_loss"]
        while printed < run["current_round"]:
            row = losses.get(printed, {})
            cells = "  ".join(f"path {p}: {row[p]:.3f}" for p in sorted(row))
            console.print(f"    round {printed}: {cells}")
            printed += 1
        if run["status"] == "finished":
            return losses
        islands_alive = [name for name, p in procs[1:] if p.poll() is None]
        if not islands_alive:
            raise RuntimeError(f"every island exited before the run finished; see the logs in {logs}")
        time.sleep(0.5)


def _report(client: httpx.Client, run_id: int, losses: dict[int, dict[int, float]]) -> None:
    table = Table(title="mean inner train loss per round (nats/token)")
    paths = sorted({p for row in losses.values() for p in row})
    table.add_column("round")
    for p in paths:
        table.add_column(f"path {p}")
    for rnd in sorted(losses):
        table.add_row(str(rnd), *(f"{losses[rnd].get(p, float('nan')):.3f}" for p in paths))
    console.print(table)
    modules = client.get("/v1/modules", params={"run_id": run_id}).json()["data"]
    mt = Table(title="modules")
    for col in ("id", "level", "level_name", "index", "sharing", "version", "params", "weights"):
        mt.add_column(col)
    for m in modules:
        mt.add_row(
            str(m["id"]),
            str(m["level"]),
            m["level_name"],
            str(m["index"]),
            m["sharing"],
            str(m["version"]),
            str(m["num_params"]),
            m["weights_hash"][:12],
        )
    console.print(mt)
    first, last = min(losses), max(losses)
    mean = lambda row: sum(row.values()) / len(row)  # noqa: E731
    console.print(f"train loss: round {first} {mean(losses[first]):.3f} -> round {last} {mean(losses[last]):.3f}")
