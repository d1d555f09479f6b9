"""dipaco: the `dipaco` command line, composed from the packages' own Typer apps, and the demo."""

__all__: list[str] = []
