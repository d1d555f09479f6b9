"""What the deploy tests share: where things are, and checking a `dipaco ...` command line against the real CLI
without running it (the command exists, its options exist, their values parse, required ones are given).

Typer >= 0.2x carries its own copy of click, so commands are handled by what they have (`commands`, `params`,
`make_context`), not by click's classes."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.main import get_command

from dipaco.cli import app

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


@dataclass(frozen=True, slots=True)
class Parsed:
    path: tuple[str, ...]
    """The subcommands, e.g. ("router", "shard")."""
    flags: frozenset[str]
    """The long options given, e.g. {"--corpus", "--out"}."""
    command: Any
    """The (Typer) click command."""


class CommandError(Exception):
    """The CLI would refuse this command line."""


def command_path(args: list[str]) -> tuple[tuple[str, ...], Any, list[str]]:
    """Walk `dipaco ARGS` down the command groups: (subcommand names, the command reached, the rest)."""
    node: Any = get_command(app)
    path: list[str] = []
    rest = list(args)
    while hasattr(node, "commands") and rest and rest[0] in node.commands:
        name = rest.pop(0)
        path.append(name)
        node = node.commands[name]
    return tuple(path), node, rest


@contextmanager
def only_environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ without the test process's DIPACO_* / AWS_* variables and with `env` on top (click reads an
    option's envvar from os.environ); restored afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith(("DIPACO_", "AWS_"))})
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_dipaco(args: list[str], env: Mapping[str, str] | None = None) -> Parsed:
    """Parse `dipaco ARGS` the way the CLI would, with `env` as the process's DIPACO_* environment; raise
    CommandError (unknown command or option, bad value, missing required option) when it would refuse."""
    if not args or args[0] != "dipaco":
        raise CommandError(f"not a dipaco command: {args}")
    path, node, rest = command_path(args[1:])
    if hasattr(node, "commands"):
        raise CommandError(f"`dipaco {' '.join(path)}` is a group, not a command (next word: {rest[:1]})")
    with only_environment(env or {}):
        try:
            node.make_context("dipaco " + " ".join(path), list(rest))
        except Exception as exc:  # click's UsageError / BadParameter / MissingParameter, from Typer's copy
            if not (type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 1) == 0):  # --help: fine
                raise CommandError(f"`{shlex.join(args)}`: {exc.__class__.__name__}: {exc}") from exc
    flags = frozenset(a.split("=", 1)[0] for a in rest if a.startswith("--"))
    return Parsed(path=path, flags=flags, command=node)


def envvars_of(command: Any, flag: str) -> set[str]:
    """The environment variables that can stand in for `flag` of `command`."""
    for param in command.params:
        if param.param_type_name == "option" and flag in (*param.opts, *param.secondary_opts):
            envvar = param.envvar
            if envvar is None:
                return set()
            return {envvar} if isinstance(envvar, str) else set(envvar)
    return set()


SHELL_VAR = re.compile(r"^\$\{?\w+\}?$")
ASSIGN_OUTPUT = re.compile(r"^\w+=\$\((.*)\)$")


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a small shell script, one per line (comments and control lines kept as words; the
    command of `VAR=$(command)` taken out). A word that is only a shell variable ($1, ${RUN}) stands for a value
    the script computes: it becomes "1"."""
    commands = []
    for line in script.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        substitution = ASSIGN_OUTPUT.match(line)
        if substitution:
            line = substitution.group(1)
        words = shlex.split(line, comments=True)
        commands.append(["1" if SHELL_VAR.match(w) else w for w in words])
    return commands


def code_lines(text: str) -> list[list[str]]:
    """The lines of a markdown text's fenced code blocks as shell words (comments dropped, `\\` continuations
    joined); lines that are not shell (unbalanced quotes) are left out."""
    found: list[list[str]] = []
    in_block = False
    pending = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            in_block = not in_block
            pending = ""
            continue
        if not in_block:
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if words:
            found.append(words)
    return found


IMAGE = re.compile(r"^dipaco:(cpu|cuda)$")
PASS_THROUGH = {"dipaco", "torchrun", "python", "python3", "sh", "bash"}


def embedded_dipaco(words: list[str]) -> list[str] | None:
    """The `dipaco ...` command inside a command line, if any: `dipaco ...` itself, a path ending in /dipaco,
    `-m dipaco ...` (torchrun, python), or the image's arguments after `dipaco:cpu|cuda` (its entrypoint runs
    `dipaco ARGS` unless ARGS start with another program)."""
    for i, word in enumerate(words):
        image_args = words[:2] == ["docker", "run"] and IMAGE.match(word) and i + 1 < len(words)
        if image_args and words[i + 1] not in PASS_THROUGH:
            return ["dipaco", *words[i + 1 :]]
        if (word == "dipaco" or word.endswith("/dipaco")) and i + 1 < len(words):
            if words[i + 1] in command_path([])[1].commands:
                return ["dipaco", *words[i + 1 :]]
    return None


def markdown_commands(text: str, *, inline: bool = True) -> list[list[str]]:
    """`dipaco ...` command lines of a markdown text: lines of fenced code blocks (comments dropped, `\\`
    continuations joined) and, with `inline`, code spans in the prose that start with `dipaco `."""
    found: list[list[str]] = []
    in_block = False
    pending = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            in_block = not in_block
            pending = ""
            continue
        if in_block:
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote in prose-like lines: not a command
                continue
            if words and words[0] == "dipaco":
                found.append(words)
        elif inline:
            for span in re.findall(r"`(dipaco [^`]+)`", raw):
                found.append(shlex.split(span))
    return found
