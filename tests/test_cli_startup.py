"""A fast CLI: `dipaco --help`, `dipaco coordinator tokens` and `dipaco registry ...` import neither torch nor numpy,
scikit-learn or the server stack (`python -X importtime` in a fresh interpreter lists every module it imported);
the lazy commands' one-line help in `dipaco --help` is the loaded command's own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command

from dipaco.cli import LAZY, app
from island.distributed import free_port

HEAVY = ("torch", "numpy", "sklearn", "scipy", "fastapi", "sqlalchemy", "uvicorn", "alembic", "safetensors")
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|( *)(\S+)$")


def imported_modules(*args: str, cwd: Path | None = None) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules `python -m dipaco ARGS` imports, from `-X importtime`'s report on stderr."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dipaco", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "120"},
    )
    modules = {m.group(2) for line in proc.stderr.splitlines() if (m := IMPORTED.match(line))}
    assert "dipaco.cli" in modules, proc.stderr[-2000:]
    return modules, proc


def heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in HEAVY}


def test_help_imports_nothing_heavy() -> None:
    modules, proc = imported_modules("--help")
    assert proc.returncode == 0
    assert heavy(modules) == set()
    assert not {m for m in modules if m.startswith(("router", "island", "modules", "coordinator.client"))}
    for name in LAZY:  # every command is listed, loaded or not
        assert name in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["registry", "runs", "--token", "t" * 20],
        ["registry", "islands", "--json", "--token", "t" * 20],
        ["registry", "create-run", "--name", "r", "--token", "t" * 20],
        ["registry", "--help"],
        ["coordinator", "--help"],
    ],
)
def test_registry_commands_import_nothing_heavy(args: list[str]) -> None:
    """Against a port nothing listens on: the command runs all the way to its one request (and its error)."""
    if args[-1] != "--help":
        args = [*args, "--coordinator", f"http://127.0.0.1:{free_port()}"]
    modules, proc = imported_modules(*args)
    assert heavy(modules) == set(), proc.stderr[-3000:]
    if args[-1] != "--help":
        assert proc.returncode == 1 and "unavailable" in proc.stderr


def test_tokens_of_an_existing_file_import_nothing_heavy(tmp_path: Path) -> None:
    (tmp_path / "tokens.json").write_text('{"admin_token": "a", "join_token": "j"}')
    modules, proc = imported_modules("coordinator", "tokens", "--data-dir", str(tmp_path), "--export")
    assert proc.stdout == "export DIPACO_ADMIN_TOKEN=a DIPACO_JOIN_TOKEN=j\n"
    assert heavy(modules) == set()


def test_lazy_commands_show_their_own_help() -> None:
    root = get_command(app)
    for name, lazy in LAZY.items():
        command = root.commands[name]  # type: ignore[attr-defined]
        own = " ".join((command.help or "").split("\n\n")[0].split())
        assert lazy.help == own, f"dipaco.cli.LAZY[{name!r}].help differs from the command's own help"
