"""The one place the `dipaco` command is composed; each package owns its own subcommands.

The router group is `router.cli`'s data commands (`corpus`, `shard`) plus the two that talk to the coordinator
(`register`, `refit`, in `dipaco.router_commands`): `router/` itself stays free of HTTP.
"""

from __future__ import annotations

import typer

from coordinator.cli import app as coordinator_app
from coordinator.registry_cli import app as registry_app
from dipaco.demo import demo
from dipaco.evaluation import eval_command
from dipaco.export import export_command, generate_command
from dipaco.router_commands import refit_command, register_command
from island.cli import app as island_app
from router.cli import app as router_data_app

app = typer.Typer(
    help="dipaco: train modular language models (DiPaCo / DiLoCo) across loosely connected sites.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# a group of its own (the data commands first), so that composing does not add commands to `router.cli.app`
router_app = typer.Typer(help=router_data_app.info.help, no_args_is_help=True)
router_app.registered_commands.extend(router_data_app.registered_commands)
router_app.command("register")(register_command)
router_app.command("refit")(refit_command)

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
