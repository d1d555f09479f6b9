"""The island's view of the coordinator: the one typed client, `coordinator.client.CoordinatorClient`.

The island constructs it as `CoordinatorClient(base_url, join_token, http=..., retry=RetryPolicy(...))`, calls
`join(name, site, capabilities)` (after which the client speaks as the island, with the island token),
`heartbeat`, `lease(wait_s=)` (+ `idle` when there is no work), `module_weights`, `shard_tokens`, `upload`,
`release`, `leave` and `close`, and reads `island_id`, `attempts` and `retries`. Nothing here is island-specific
enough to need a layer of its own: the island's session state (its id and token, the last idle reason) lives in
the client, documented there.
"""

from __future__ import annotations

from coordinator.client import (
    DEFAULT_TIMEOUT,
    UPLOAD_CHUNK,
    CoordinatorClient,
    Idle,
    IdleReason,
    RetryPolicy,
    sha256_hex,
)

__all__ = ["DEFAULT_TIMEOUT", "UPLOAD_CHUNK", "CoordinatorClient", "Idle", "IdleReason", "RetryPolicy", "sha256_hex"]
