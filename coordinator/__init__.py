"""The coordinator service: registry database, blob store, round protocol and REST API."""

from coordinator.app import create_app
from coordinator.settings import Settings

__all__ = ["Settings", "create_app"]
