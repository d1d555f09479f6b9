"""The worker island: coordinator client, lease loop (lease → fetch → train H steps → upload), cache."""

from island.cache import BlobCache
from island.client import CoordinatorClient, RetryPolicy
from island.errors import (
    ClientError,
    CoordinatorUnavailable,
    IntegrityError,
    IslandError,
    LeaseLost,
    RequestRejected,
)
from island.worker import Island, IslandConfig

__all__ = [
    "BlobCache",
    "ClientError",
    "CoordinatorClient",
    "CoordinatorUnavailable",
    "Island",
    "IslandConfig",
    "IslandError",
    "IntegrityError",
    "LeaseLost",
    "RequestRejected",
    "RetryPolicy",
]
