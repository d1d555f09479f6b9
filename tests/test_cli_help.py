"""Help that keeps its hints: every command's `--help`, rendered as a person sees it (Rich markup on), shows each
option's help text whole. Rich reads `[...]` as markup and drops it, which once turned "Island name [default:
hostname-pid]." into "Island name ." and removed "[env DIPACO_DATA_DIR]" from `serve`'s options."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from dipaco.cli import app

EMPTY = re.compile(r"\(\s*\)|\[\s*\]|\w \.(\s|$)")


def commands(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, node
    for name, sub in sorted(getattr(node, "commands", {}).items()):
        yield from commands(sub, (*path, name))


ALL = list(commands(get_command(app)))


def flat(text: str) -> str:
    """Rendered help as one line: box drawing and line breaks gone, spaces collapsed."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_every_command_is_walked() -> None:
    paths = {path for path, _ in ALL}
    assert {("coordinator", "tokens"), ("registry", "create-run"), ("island", "join"), ("router", "refit")} <= paths


@pytest.mark.parametrize("path", [path for path, _ in ALL], ids=lambda p: " ".join(p) or "dipaco")
def test_help_shows_every_hint(path: tuple[str, ...]) -> None:
    node = dict(ALL)[path]
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "2000"})
    assert result.exit_code == 0, result.output
    shown = flat(result.output)
    if node.help:
        first = " ".join(node.help.split("\n\n")[0].split())
        assert first in shown, f"`dipaco {' '.join(path)}`: its description lost text"
    for param in getattr(node, "params", []):
        help_text = getattr(param, "help", None)
        if not help_text:
            continue
        assert " ".join(help_text.split()) in shown, f"`dipaco {' '.join(path)}` {param.opts}: help lost text"
        if getattr(param, "envvar", None) and getattr(param, "show_envvar", False):
            envvars = [param.envvar] if isinstance(param.envvar, str) else param.envvar
            for envvar in envvars:
                assert f"env var: {envvar}" in shown, f"`dipaco {' '.join(path)}` {param.opts}: {envvar} not shown"
    assert not EMPTY.search(shown), f"`dipaco {' '.join(path)}`: {EMPTY.search(shown)!r} in its help"
