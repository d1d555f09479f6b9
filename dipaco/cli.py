"""The one place the `dipaco` command is composed; each package owns its own subcommands."""

from __future__ import annotations

import typer

from coordinator.cli import app as coordinator_app
from coordinator.registry_cli import app as registry_app
from dipaco.demo import demo
from dipaco.export import export_command, generate_command
from island.cli import app as island_app
from router.cli import app as router_app
from router.eval_cli import eval_command

app = typer.Typer(
    help="dipaco: train modular language models (DiPaCo / DiLoCo) across loosely connected sites.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(island_app, name="island")
app.add_typer(router_app, name="router")
app.add_typer(registry_app, name="registry")
app.command()(demo)
app.command("eval")(eval_command)
app.command("export")(export_command)
app.command("generate")(generate_command)


def main() -> None:
    app()
