"""The demo's closing hint: commands to copy as they are (each parses with the real CLI, none is wrapped even on
a narrow console), the `dipaco` that ran, and no token in clear."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import pytest
from rich.console import Console

from dipaco import demo
from dipaco.service import LocalService
from tests.deploy.helpers import parse_dipaco


def commands_of(hint: str, dipaco: str) -> list[list[str]]:
    found = []
    for line in hint.splitlines()[1:]:
        line = line.strip().removesuffix(" &")
        if line.startswith('eval "$('):
            line = line.removeprefix('eval "$(').removesuffix(')"')
        if line.startswith(dipaco + " "):
            found.append(["dipaco", *shlex.split(line[len(dipaco) :])])
    return found


def test_the_closing_hint_is_copy_pasteable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    service = LocalService(data_dir=tmp_path / "dipaco demo" / "coordinator", logs=tmp_path / "logs")
    hint = demo._again_hint(service)
    assert service.admin_token not in hint and service.join_token not in hint
    dipaco = demo.dipaco_command()
    commands = commands_of(hint, dipaco)
    assert [c[1:3] for c in commands] == [["coordinator", "tokens"], ["coordinator", "serve"], ["registry", "modules"]]
    for command in commands:
        parse_dipaco(command)
    assert "'dipaco demo/coordinator'" in hint  # relative to where the demo ran, quoted for the shell
    out = io.StringIO()
    Console(file=out, width=40).print(hint, soft_wrap=True, highlight=False, markup=False)
    assert out.getvalue() == hint + "\n"


def test_dipaco_command_is_the_one_that_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dipaco` on PATH: the hint names this environment's
    shown = demo.dipaco_command()
    assert shown != "dipaco" and (shown.endswith("/bin/dipaco") or shown.endswith(" -m dipaco"))
