"""An apply step on an s3:// store reads one module's bytes of each upload, not the whole upload: the header with
one ranged GET, then the module's tensors (and an int8 payload's scales) with one ranged GET per contiguous run.
Bytes are counted with boto3's own event hooks on the real client talking to moto's S3 server."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load

from coordinator.blobstore import HEAD_READ, BlobError, S3BlobStore, open_blob_store
from modules.codec import decode_grad_part, encode_grad, read_header, read_metadata

LEVELS = ("embed", "b0", "b1", "head")


@pytest.fixture
def s3(s3_env: str, tmp_path: Any) -> S3BlobStore:
    import boto3

    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket="dipaco-ranged")
    store = open_blob_store(f"s3://dipaco-ranged/{tmp_path.name}", s3_endpoint_url=s3_env)
    assert isinstance(store, S3BlobStore)
    return store


class _Counted:
    """Bytes of every GetObject reply of one store's client (its event hooks; nothing is replaced)."""

    def __init__(self, store: S3BlobStore) -> None:
        self.store = store
        self.replies: list[int] = []

    def _answer(self, parsed: dict[str, Any], **_: Any) -> None:
        self.replies.append(int(parsed.get("ContentLength", 0)))

    def __enter__(self) -> _Counted:
        self.store.client.meta.events.register("after-call.s3.GetObject", self._answer)
        return self

    def __exit__(self, *_: object) -> None:
        self.store.client.meta.events.unregister("after-call.s3.GetObject", self._answer)


def _grads(*, width: int = 128) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed/tok_emb.weight": torch.randn(257, width, generator=gen),
        "b0/attn.qkv.weight": torch.randn(3 * width, width, generator=gen),
        "b0/mlp.fc.weight": torch.randn(4 * width, width, generator=gen),
        "b1/attn.qkv.weight": torch.randn(3 * width, width, generator=gen),
        "b1/mlp.fc.weight": torch.randn(4 * width, width, generator=gen),
        "head/lm_head.weight": torch.randn(257, width, generator=gen),
    }


def _reference(data: bytes, prefix: str) -> dict[str, torch.Tensor]:
    """The module's tensors decoded from the whole payload (what the store did before: read everything)."""
    tensors = st_load(data)
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    return decode_grad_part(shapes, read_metadata(data), tensors.__getitem__, prefix)


def _offsets(data: bytes, names: list[str]) -> list[tuple[int, int]]:
    header = read_header(data)
    return sorted((int(header[n]["data_offsets"][0]), int(header[n]["data_offsets"][1])) for n in names)  # type: ignore[index]


def _span(data: bytes, names: list[str]) -> int:
    return sum(end - start for start, end in _offsets(data, names))


def _runs(data: bytes, names: list[str]) -> int:
    """How many separate byte runs hold `names` (tensors that touch make one)."""
    offsets = _offsets(data, names)
    return 1 + sum(1 for (_, end), (start, _) in zip(offsets, offsets[1:], strict=False) if start != end)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_a_module_load_fetches_the_header_and_that_module_only(s3: S3BlobStore, codec: Any) -> None:
    data = encode_grad(_grads(), codec)
    digest = s3.put_bytes(data)
    assert len(data) > 4 * HEAD_READ  # the header read is a small part of the blob
    header = read_header(data)
    for level in LEVELS:
        prefix = f"{level}/"
        with _Counted(s3) as counted:
            got = s3.load_tensors(digest, prefix, verified=set())
        want = _reference(data, prefix)
        assert got.keys() == want.keys() and got
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
        needed = [n for n in header if n.startswith(prefix)] + (["::scales"] if codec == "int8" else [])
        # the header read, then one GET per run: a module's tensors are adjacent, int8's scales may lie apart
        assert counted.replies[0] == HEAD_READ
        assert sum(counted.replies[1:]) == _span(data, needed)
        assert len(counted.replies) == 1 + _runs(data, needed) <= (3 if codec == "int8" else 2)
        assert sum(counted.replies[1:]) < len(data) / 2  # no module here is half of the upload


def test_sparse_rows_and_a_long_header_take_one_more_get_each(s3: S3BlobStore, monkeypatch: Any) -> None:
    """The row ids of sparse rows are int64, laid out apart from the values; a header longer than the first read
    is read with a second GET."""
    from coordinator import blobstore

    grads = _grads()
    rows = torch.tensor([1, 5, 200])
    data = encode_grad(grads, "fp32", rows={"embed/tok_emb.weight": rows})
    digest = s3.put_bytes(data)
    monkeypatch.setattr(blobstore, "HEAD_READ", 16)
    with _Counted(s3) as counted:
        got = s3.load_tensors(digest, "embed/", verified=set())
    assert torch.equal(got["tok_emb.weight::rows"], rows)
    torch.testing.assert_close(got["tok_emb.weight"], grads["embed/tok_emb.weight"][rows], rtol=0, atol=0)
    n = int.from_bytes(data[:8], "little")
    assert counted.replies[:2] == [16, 8 + n - 16]
    assert len(counted.replies) == 4 and sum(counted.replies[2:]) == _span(
        data, ["embed/tok_emb.weight", "embed/tok_emb.weight::rows"]
    )


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda data: data + b"\0" * 8, "the tensors end at byte"),
        (lambda data: data[:-8], "bad safetensors entry"),
        (lambda data: (1 << 40).to_bytes(8, "little") + data[8:], "a safetensors header of 1099511627776 bytes"),
    ],
)
def test_a_blob_whose_layout_does_not_add_up_is_refused(s3: S3BlobStore, tamper: Any, message: str) -> None:
    """What a ranged read still checks without hashing: the header, and that it accounts for the whole object."""
    data = encode_grad(_grads(width=16), "fp32")
    digest = s3.put_bytes(data)
    s3.client.put_object(Bucket=s3.bucket, Key=s3.key(digest), Body=tamper(data))
    with pytest.raises(BlobError, match=message):
        s3.load_tensors(digest, "b0/", verified=set())
