"""TLS end to end: `serve --ssl-certfile/--ssl-keyfile` answers https only, and the island and the CLIs trust a
coordinator's own certificate authority with `--ca-file` (and refuse it, saying why, without)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from island.distributed import free_port
from tests.conftest import ADMIN, JOIN

pytestmark = pytest.mark.integration


def _certificate(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA), made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificate to test TLS with")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _dipaco(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dipaco", *args], capture_output=True, text=True, env=env, timeout=120)


def test_https_coordinator_with_its_own_ca(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    port = free_port()
    env = {**os.environ, "DIPACO_ADMIN_TOKEN": ADMIN, "DIPACO_JOIN_TOKEN": JOIN, "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "coordinator.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "dipaco", "coordinator", "serve", "--port", str(port), "--data-dir",
         str(tmp_path / "data"), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (tmp_path / "coordinator.log").read_text()
            try:
                if httpx.get(f"{url}/healthz", verify=trust, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "coordinator did not answer https"
                time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # plain http on the same port gets nothing useful
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).raise_for_status()

        trusted = _dipaco("registry", "runs", "--coordinator", url, "--token", ADMIN, "--ca-file", str(cert), env=env)
        assert trusted.returncode == 0 and "runs (0)" in trusted.stdout, trusted.stderr
        untrusted = _dipaco("registry", "runs", "--coordinator", url, "--token", ADMIN, env=env)
        assert untrusted.returncode == 1
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr.replace("\n", ""), untrusted.stderr

        island = _dipaco(
            "island", "join", "--coordinator", url, "--token", JOIN, "--ca-file", str(cert), "--name", "tls-island",
            "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--no-probe", "--quiet", "--exit-when-idle",
            env=env,
        )  # fmt: skip
        assert island.returncode == 0, island.stderr[-2000:]
        islands = _dipaco("registry", "islands", "--coordinator", url, "--json", "--ca-file", str(cert), env=env)
        assert '"name": "tls-island"' in islands.stdout and '"status": "left"' in islands.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
