"""The one place the `dipaco` command is composed; each package owns its own subcommands.

The router group is `router.cli`'s data commands (`corpus`, `shard`) plus the two that talk to the coordinator
(`register`, `refit`, in `dipaco.router_commands`): `router/` itself stays free of HTTP.

Start-up time: importing `router` or `island` loads scikit-learn and torch (their package `__init__`s import
everything), a few seconds on a small machine. So the groups and commands that need them are *lazy*: the root
group knows their names and one-line help, and imports a command's module only when that command is run or its
own `--help` is asked for. `dipaco --help`, `dipaco coordinator ...` (apart from what `serve` imports to serve)
and `dipaco registry ...` import neither torch nor numpy (tests/test_cli_startup.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup
from typer.main import get_command

from coordinator.cli import app as coordinator_app
from coordinator.registry_cli import app as registry_app


def _command(target: str, name: str) -> Callable[[], Any]:
    """A loader of the command function `module:function`, named `name`."""

    def load() -> Any:
        module, function = target.split(":")
        single = typer.Typer()
        single.command(name)(getattr(importlib.import_module(module), function))
        return get_command(single)

    return load


def _island() -> Any:
    from island.cli import app as island_app

    return get_command(island_app)


def _router() -> Any:
    from dipaco.router_commands import refit_command, register_command
    from router.cli import app as router_data_app

    # a group of its own (the data commands first), so that composing does not add commands to `router.cli.app`
    router_app = typer.Typer(help=router_data_app.info.help, no_args_is_help=True)
    router_app.registered_commands.extend(router_data_app.registered_commands)
    router_app.command("register")(register_command)
    router_app.command("refit")(refit_command)
    return get_command(router_app)


@dataclass(frozen=True, slots=True)
class Lazy:
    """A subcommand imported on first use."""

    load: Callable[[], Any]
    """Returns the click command (or group)."""
    help: str
    """What `dipaco --help` shows for it without loading it (tests/test_cli_startup.py checks it against the
    loaded command's own help)."""


LAZY: dict[str, Lazy] = {
    "island": Lazy(_island, "Join a DiPaCo run as a worker island."),
    "router": Lazy(_router, "Corpus and routing: build the local corpus, fit the router, write shards."),
    "demo": Lazy(
        _command("dipaco.demo:demo", "demo"),
        "Run everything on this machine: coordinator, corpus, router, a 2x2 run and island subprocesses; then "
        "compare held-out perplexity against dense baselines and a flat 4-expert layout.",
    ),
    "eval": Lazy(
        _command("dipaco.evaluation:eval_command", "eval"),
        "Routed held-out perplexity of a run: each document goes to one path by its prefix; the prefix is not scored.",
    ),
    "export": Lazy(
        _command("dipaco.export:export_command", "export"),
        "Export one path of a run (current module versions) as a standalone safetensors file + config.json.",
    ),
    "generate": Lazy(
        _command("dipaco.export:generate_command", "generate"),
        "Sample text from an exported path (--from DIR) or from a run with routing (--coordinator, --run, --router).",
    ),
}
ORDER = ["coordinator", "island", "router", "registry", "demo", "eval", "export", "generate"]


class LazyGroup(TyperGroup):
    """The root group: the commands in `LAZY` are loaded by name, when first resolved. While it formats its own
    help it lists the lazy ones by their `Lazy.help` instead of loading them. Reading `commands` (what tools and
    tests walk) loads them all."""

    _formatting_help = False
    _loaded: dict[str, Any]

    @property  # type: ignore[override]
    def commands(self) -> dict[str, Any]:
        for name in LAZY:
            self.get_command(None, name)
        return self._loaded

    @commands.setter
    def commands(self, value: Any) -> None:
        self._loaded = dict(value)

    def add_command(self, cmd: Any, name: str | None = None) -> None:
        self._loaded[name or cmd.name] = cmd

    def list_commands(self, ctx: Any) -> list[str]:
        names = {*self._loaded, *LAZY}
        return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in self._loaded:
            return self._loaded[cmd_name]
        lazy = LAZY.get(cmd_name)
        if lazy is None:
            return None
        if self._formatting_help:
            return TyperCommand(cmd_name, help=lazy.help)
        command = lazy.load()
        command.name = cmd_name
        self._loaded[cmd_name] = command
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._formatting_help = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._formatting_help = False


app = typer.Typer(
    cls=LazyGroup,
    help="dipaco: train modular language models (DiPaCo / DiLoCo) across loosely connected sites.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(registry_app, name="registry")


def main() -> None:
    app()
