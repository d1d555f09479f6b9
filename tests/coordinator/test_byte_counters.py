"""`/metrics` byte counters on the local blob store: every tensor and token byte that passes through the coordinator
is counted once, under its `kind` (`outer_gradient`, `weights`, `shard`) and direction, and nothing else moves.
(With an S3 store nothing passes through: tests/coordinator/test_direct_transfers.py.)"""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from modules import encode
from tests.coordinator.helpers import create_running_run, join, lease, train_lease, upload

COUNTER = re.compile(r'^dipaco_bytes_(in|out)_total\{kind="([a-z_]+)"\} (\S+)$')


def _counters(client: TestClient) -> dict[tuple[str, str], float]:
    """(direction, kind) -> bytes, for every byte counter the app shows."""
    found = {}
    for line in client.get("/metrics").text.splitlines():
        if match := COUNTER.match(line):
            found[(match[1], match[2])] = float(match[3])
    return found


def _plus(before: dict[tuple[str, str], float], key: tuple[str, str], size: int) -> dict[tuple[str, str], float]:
    return {**before, key: before.get(key, 0.0) + size}


def test_uploads_weights_and_tokens_through_the_coordinator_are_counted_by_kind(client: TestClient) -> None:
    create_running_run(client, num_tokens=400)  # four shards of 400 uint16 tokens registered
    zero = {("in", "outer_gradient"): 0.0, ("in", "shard"): 0.0, ("out", "shard"): 0.0, ("out", "weights"): 0.0}
    assert _counters(client) == {**zero, ("in", "shard"): 4 * 400 * 2}  # every kind shown from the start
    island_id, h = join(client)
    body = lease(client, island_id, h)
    assert body is not None

    before = _counters(client)
    sizes = []
    for m in body["modules"]:
        r = client.get(f"/v1/modules/{m['module_id']}/weights?version={m['version']}", headers=h)
        assert r.status_code == 200 and len(r.content) > 0
        sizes.append(len(r.content))
        again = client.get(f"/v1/modules/{m['module_id']}/weights", headers={**h, "If-None-Match": r.headers["ETag"]})
        assert again.status_code == 304  # the island's cache is current: nothing sent, nothing counted
    assert _counters(client) == _plus(before, ("out", "weights"), sum(sizes))

    before = _counters(client)
    r = client.get(f"/v1/shards/{body['shard']['shard_id']}/tokens", headers=h)
    assert r.status_code == 200 and len(r.content) == 400 * 2
    again = client.get(
        f"/v1/shards/{body['shard']['shard_id']}/tokens", headers={**h, "If-None-Match": r.headers["ETag"]}
    )
    assert again.status_code == 304
    assert _counters(client) == _plus(before, ("out", "shard"), len(r.content))

    payload = encode(train_lease(client, body, h))  # fetches the weights and tokens again
    before = _counters(client)
    assert upload(client, body, h, payload).status_code == 200
    assert _counters(client) == _plus(before, ("in", "outer_gradient"), len(payload))
