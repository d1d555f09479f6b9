"""The coordinator service: registry database, blob store, round protocol and REST API.

Import from the submodules (`coordinator.app.create_app`, `coordinator.settings.Settings`); this package's
`__init__` stays empty so that islands can import `coordinator.schemas` without loading the server.
"""

__all__: list[str] = []
