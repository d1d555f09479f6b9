"""The README's walkthrough ("Using it") runs as written: its marked bash blocks, in order, as one bash script in
an empty directory, with the small settings below put in place of the README's (each must be found, so a change
of the README that a substitution no longer matches fails here instead of silently running the long version).

A real coordinator, a real island and every command of the walkthrough run; the test checks what a newcomer
would look at: the run started and finished, tables are not cut, the export's files, the tokens file's mode,
and that no token was printed."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from island.distributed import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- walkthrough"
RUN_LIMIT_S = 200.0


def walkthrough_blocks(text: str) -> list[str]:
    """The bash blocks of the README that follow a `<!-- walkthrough ... -->` line, in order."""
    blocks: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith(MARK):
            start = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            assert lines[start] == "```bash", f"README line {start + 1}: the walkthrough's blocks are bash"
            end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append("\n".join(lines[start + 1 : end]))
            i = end
        i += 1
    return blocks


def small_settings(port: int) -> list[tuple[str, str]]:
    """(README text, what the test runs instead): the same commands, with the README's long settings made small,
    the environment this test runs in, and a free port."""
    activate = Path(sys.prefix) / "bin" / "activate"
    environment = f"source {activate}" if activate.is_file() else f"export PATH={Path(sys.executable).parent}:$PATH"
    return [
        ("make venv\n", ":\n"),  # the test runs inside the environment already
        ("source .venv/bin/activate", environment),
        ("--port 8000", f"--port {port}"),
        ("http://127.0.0.1:8000", f"http://127.0.0.1:{port}"),
        ("--rounds 10", "--rounds 1"),
        ("--inner-steps 50", "--inner-steps 4"),
        ("dipaco router corpus --out corpus\n", "dipaco router corpus --out corpus --max-docs-per-domain 16\n"),
    ]


def test_blocks_are_found() -> None:
    blocks = walkthrough_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    script = "\n".join(blocks)
    for command in ("coordinator tokens", "registry create-run", "router register", "island join", "eval", "export"):
        assert f"dipaco {command}" in script


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    port = free_port()
    script = "\n".join(walkthrough_blocks((ROOT / "README.md").read_text())) + "\n"
    for readme, small in small_settings(port):
        assert readme in script, f"the README's walkthrough no longer has {readme!r}: update small_settings()"
        script = script.replace(readme, small)
    work = tmp_path / "clone"
    work.mkdir()
    (work / "walkthrough.sh").write_text("set -eo pipefail\n" + script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIPACO_")}
    env["HOME"] = str(tmp_path / "home")  # the island's cache (~/.cache/dipaco) stays in the test's directory
    proc = subprocess.Popen(
        ["bash", "walkthrough.sh"],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the background coordinator goes with it
    )
    try:
        output, _ = proc.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the walkthrough took over {RUN_LIMIT_S:.0f} s:\n{output[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    log = (work / "coordinator.log").read_text() if (work / "coordinator.log").exists() else ""
    assert proc.returncode == 0, f"{output[-8000:]}\n--- coordinator.log ---\n{log[-3000:]}"

    # step 3: registering the last shard started the run, and the command says so
    assert "run 1 'r1' is running: round 0 of 1" in output
    # step 4: the island trained and left; the table shows the whole layout although stdout is not a terminal
    assert re.search(r"│ 1\s+│ r1\s+│ finished", output), output[-4000:]
    assert "embed:shared, b0-0:routed2, b1-1:routed2, head:shared" in output
    # steps 5-7, and the second run on the refit shards
    assert "run 1 (r1), round 1: heldout" in output and "run 2 (r2), round 1: heldout" in output
    assert "eval: scoring" in output and "refit: scoring" in output  # progress lines
    assert "exported run 1 path 0" in output
    assert "run 1, path" in output and "export exports/path0" in output
    export = work / "exports" / "path0"
    modes = {stat.S_IMODE((export / name).stat().st_mode) for name in ("model.safetensors", "config.json")}
    assert len(modes) == 1, f"the export's files have different modes: {modes}"
    # the tokens: private, and never printed
    tokens = work / ".dipaco" / "tokens.json"
    assert stat.S_IMODE(tokens.stat().st_mode) == 0o600
    for token in json.loads(tokens.read_text()).values():
        assert token not in output
