"""Command-line options shared by every command that talks to a coordinator (`dipaco registry ...`, `eval`,
`export`, `generate`, `router register|refit`). Imports only Typer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

CaFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--ca-file",
        envvar="DIPACO_CA_FILE",
        exists=True,
        dir_okay=False,
        help="PEM file of the certificate authority to trust for an https coordinator with its own certificate "
        "(default: the system's).",
        show_default=False,
    ),
]
