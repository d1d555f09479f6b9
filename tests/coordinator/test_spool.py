"""Streamed request bodies over real HTTP (uvicorn on loopback, in this process): the spool thread hashes and
writes every byte in order, and an oversize or abandoned body leaves neither a temporary file nor a thread."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from coordinator.api import spool as spooling
from coordinator.schemas import GRAD_KEY_SEP
from coordinator.services.uploads import UploadDesk
from coordinator.settings import Settings
from modules import ModelConfig, encode, level_param_shapes, parse_layout
from tests.conftest import ADMIN, FakeClock
from tests.coordinator.helpers import TINY_RUN, A, J, served

RUN = {**TINY_RUN, "model": {**TINY_RUN["model"], "d_model": 192}}
"""A path's outer gradients are ~3.6 MB here: several spool buffers and a partial last one."""


def spool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dipaco-spool-")]


def assert_nothing_left(settings: Settings) -> None:
    """No spool thread outlives its request (given a moment to exit), no temporary file stays behind."""
    for t in spool_threads():
        t.join(timeout=10)
    assert spool_threads() == []
    assert spooled_files(settings.data_dir / "spool") == []


def spooled_files(spool: Path) -> list[Path]:
    """Upload files under the spool root (each process spools in a directory of its own there)."""
    return [p for p in spool.rglob("*") if p.is_file()]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def in_pieces(data: bytes, size: int) -> Iterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield view[start : start + size]


def running_lease(http: httpx.Client) -> tuple[dict[str, Any], dict[str, str]]:
    run = http.post("/v1/runs", json=RUN, headers=A).json()
    for p in range(run["num_paths"]):
        tokens = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(p)).to(torch.int16)
        r = http.post(f"/v1/runs/{run['id']}/shards/{p}?num_documents=2", content=tokens.numpy().tobytes(), headers=A)
        assert r.status_code == 201, r.text
    joined = http.post("/v1/islands", json={"name": "spool"}, headers=J).json()
    h = {"Authorization": f"Bearer {joined['token']}"}
    r = http.post(f"/v1/islands/{joined['island_id']}/lease", headers=h)
    assert r.status_code == 200, r.text
    return r.json(), h


def outer_gradients(lease: dict[str, Any]) -> bytes:
    cfg = ModelConfig.from_dict(lease["model"])
    layout = parse_layout(RUN["layout"], n_layers=cfg.n_layers)
    gen = torch.Generator().manual_seed(0)
    grads = {
        f"{m['level_name']}{GRAD_KEY_SEP}{name}": torch.randn(shape, generator=gen) * 1e-3
        for m in lease["modules"]
        for name, shape in level_param_shapes(cfg, layout, m["level"]).items()
    }
    return encode(grads)


def upload_headers(lease: dict[str, Any], h: dict[str, str]) -> dict[str, str]:
    return {**h, "X-Dipaco-Round": str(lease["round"]), "X-Dipaco-Tokens": "32", "X-Dipaco-Train-Loss": "5.0"}


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page-cache"])
@pytest.mark.parametrize("buffer,in_flight", [(spooling.SPOOL_BUFFER, spooling.SPOOL_IN_FLIGHT), (100_003, 1)])
def test_body_in_odd_pieces_is_hashed_and_stored_byte_for_byte(
    settings: Settings,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    buffer: int,
    in_flight: int,
    direct: bool,
) -> None:
    # (100_003, 1): many buffers, each straddling the server's chunks, and the event loop waiting on every one;
    # its values checked as they stream in (`PayloadStream`), the file written past the page cache or through it
    monkeypatch.setattr(spooling, "SPOOL_BUFFER", buffer)
    monkeypatch.setattr(spooling, "SPOOL_IN_FLIGHT", in_flight)
    settings.upload_stream_check_bytes = 0
    settings.spool_direct = direct
    with served(settings, clock) as url, httpx.Client(base_url=url, timeout=60) as http:
        lease, h = running_lease(http)
        payload = outer_gradients(lease)
        assert len(payload) > 3 * (1 << 20)
        r = http.post(
            f"/v1/leases/{lease['lease_id']}/outer-gradients",
            content=in_pieces(payload, 77_777),
            headers={**upload_headers(lease, h), "Content-Length": str(len(payload))},
        )
        assert r.status_code == 200, r.text
    digest = hashlib.sha256(payload).hexdigest()
    stored = Path(settings.resolved_blob_url) / digest[:2] / digest  # named by the hash the spool computed
    assert stored.read_bytes() == payload
    assert_nothing_left(settings)


def test_a_large_body_that_names_its_hash_is_spooled_unhashed_and_staged_byte_for_byte(
    settings: Settings, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # many spool-thread buffers, none hashed: the staged file must still be the body, byte for byte
    monkeypatch.setattr(spooling, "SPOOL_BUFFER", 100_003)
    settings.apply_workers = 0  # nothing promotes it: the staged copy is what the request left
    settings.upload_stream_check_bytes = 1 << 20  # the body (> 3 MiB) is a large one
    with served(settings, clock) as url, httpx.Client(base_url=url, timeout=60) as http:
        lease, h = running_lease(http)
        payload = outer_gradients(lease)
        digest = hashlib.sha256(payload).hexdigest()
        r = http.post(
            f"/v1/leases/{lease['lease_id']}/outer-gradients",
            content=in_pieces(payload, 77_777),
            headers={
                **upload_headers(lease, h),
                "Content-Length": str(len(payload)),
                "X-Dipaco-Content-Sha256": digest,
            },
        )
        assert r.status_code == 200, r.text
    staged = Path(settings.resolved_blob_url) / "staging" / f"{lease['lease_id']}-{digest}"
    assert staged.read_bytes() == payload
    assert not (Path(settings.resolved_blob_url) / digest[:2] / digest).exists()  # not named until verified
    assert_nothing_left(settings)


def test_body_over_the_limit_without_a_length_is_refused_mid_stream(settings: Settings, clock: FakeClock) -> None:
    settings.max_upload_bytes = 3_000_000  # past the first spool buffers: the spool thread is running by then
    with served(settings, clock) as url, httpx.Client(base_url=url, timeout=60) as http:
        joined = http.post("/v1/islands", json={"name": "big"}, headers=J).json()
        h = {"Authorization": f"Bearer {joined['token']}"}
        r = http.post(  # a generator without Content-Length: chunked, so only counting the bytes can stop it
            "/v1/leases/1/outer-gradients",
            content=in_pieces(b"\x00" * 3_200_000, 65_536),
            headers={**h, "X-Dipaco-Tokens": "1", "X-Dipaco-Train-Loss": "1.0"},
        )
        assert r.status_code == 413 and r.json()["detail"] == "body is over the 3000000-byte limit", r.text
        assert_nothing_left(settings)


def test_client_gone_mid_body_leaves_no_spool_file(settings: Settings, clock: FakeClock) -> None:
    spool = settings.data_dir / "spool"
    with served(settings, clock) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/runs/1/shards/0?num_documents=1 HTTP/1.1\r\n"
                + f"Host: {host}\r\nAuthorization: Bearer {ADMIN}\r\nContent-Length: 4000000\r\n\r\n".encode()
            )
            s.sendall(b"\x01\x00" * 750_000)
            wait_for(lambda: bool(spooled_files(spool)), "the server to start spooling")
        # closed after 1.5 of 4 MB: the server sees the disconnect, stops the spool thread, removes the file
        wait_for(lambda: not spooled_files(spool), "the spool file to be removed")
        assert_nothing_left(settings)


def test_write_error_on_the_spool_thread_fails_the_request_and_leaves_nothing(
    settings: Settings, clock: FakeClock
) -> None:
    """A real write error: with RLIMIT_FSIZE at 1.5 MB, writing past it fails with EFBIG (SIGXFSZ ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with served(settings, clock) as url, httpx.Client(base_url=url, timeout=60) as http:
            joined = http.post("/v1/islands", json={"name": "full"}, headers=J).json()
            h = {"Authorization": f"Bearer {joined['token']}"}
            resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, hard))
            try:
                r = http.post(
                    "/v1/leases/1/outer-gradients",
                    content=in_pieces(b"\x00" * 3_000_000, 65_536),
                    headers={**h, "X-Dipaco-Tokens": "1", "X-Dipaco-Train-Loss": "1.0", "Content-Length": "3000000"},
                )
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            assert r.status_code == 500, r.text  # the island retries a 5xx
            assert_nothing_left(settings)
    finally:
        signal.signal(signal.SIGXFSZ, previous)


def _spool_fsyncs(monkeypatch: pytest.MonkeyPatch, settings: Settings, *, fail: bool) -> list[tuple[str, int]]:
    """Record (or fail with EIO) the fsyncs of files under the spool directory, with the thread that ran each;
    others run as they are."""
    real, spool, seen = os.fsync, str(settings.data_dir / "spool"), []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(spool):
            seen.append((path, threading.get_ident()))
            if fail:
                raise OSError(5, "Input/output error (injected)")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@pytest.mark.parametrize("fail", [False, True], ids=["synced", "eio"])
@pytest.mark.parametrize("threaded", [True, False], ids=["spool-thread", "in-place"])
def test_the_spool_makes_the_body_durable_and_a_failed_fsync_fails_the_upload(
    settings: Settings, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, fail: bool, threaded: bool
) -> None:
    # before the upload takes its locks (`put_file`'s fsync then has nothing left to flush); a body under one
    # buffer is written in place and synced on the worker thread that then runs `accept` (one hop, not two)
    if not threaded:
        monkeypatch.setattr(spooling, "SPOOL_BUFFER", 8 << 20)
    with served(settings, clock) as url, httpx.Client(base_url=url, timeout=60) as http:
        lease, h = running_lease(http)
        payload = outer_gradients(lease)
        synced = _spool_fsyncs(monkeypatch, settings, fail=fail)
        accepting: list[tuple[int, int]] = []  # (thread, spool fsyncs before it)
        real_accept = UploadDesk.accept

        def accept(desk: UploadDesk, upload: Any) -> Any:
            accepting.append((threading.get_ident(), len(synced)))
            return real_accept(desk, upload)

        monkeypatch.setattr(UploadDesk, "accept", accept)
        hops: list[object] = []  # the spool's own trips to a worker thread
        real_hop = spooling.run_in_threadpool

        async def hop(func: Any, *args: Any) -> Any:
            hops.append(func)
            return await real_hop(func, *args)

        monkeypatch.setattr(spooling, "run_in_threadpool", hop)
        r = http.post(
            f"/v1/leases/{lease['lease_id']}/outer-gradients",
            content=payload,
            headers={**upload_headers(lease, h), "Content-Length": str(len(payload))},
        )
        assert len(synced) >= 1  # the spool file
        if not fail:
            assert len(accepting) == 1 and accepting[0][1] >= 1  # synced before `accept` began
            if not threaded:
                assert synced[0][1] == accepting[0][0]  # on the thread that then ran `accept`
                assert hops == []  # and not on a worker thread of its own first: under load each hop queues
        else:
            assert accepting == []  # a body that could not be made durable is never offered
        assert r.status_code == (500 if fail else 200), r.text
        if fail:
            assert "could not store the body" in r.json()["detail"] and "Input/output error" in r.json()["detail"]
        contributions = http.get("/v1/contributions", headers=A).json()["data"]
        assert len(contributions) == (0 if fail else 1)
    assert_nothing_left(settings)


@pytest.mark.parametrize("sizes", [[1], [4096], [4097], [spooling.SPOOL_BUFFER] * 5, [1_000_003, 77, 3 << 20, 4095]])
def test_the_direct_writer_stores_every_byte_and_cuts_the_file_to_its_size(tmp_path: Path, sizes: list[int]) -> None:
    path = tmp_path / "body.upload"
    path.touch()
    writer = spooling._DirectWriter.open(str(path))
    if writer is None:
        pytest.skip(f"no O_DIRECT on {tmp_path}'s filesystem")
    gen = torch.Generator().manual_seed(len(sizes))
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes() for n in sizes]
    for piece in pieces:
        writer.write(piece)
    fd = os.open(path, os.O_WRONLY)
    try:
        writer.close(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(pieces)
