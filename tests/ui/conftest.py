"""Headless Chromium from Debian's packages, driven by Playwright for Python with the system browser.

The browser is installed with apt-get when it is missing (as root); the tests skip, saying why, only where that
cannot be done. Playwright's own browser download is never used (`executable_path`)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
APT_PACKAGES = ["chromium", "chromium-driver"]
INSTALL_LOCK = "/tmp/dipaco-tests-chromium-install.lock"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def _install_chromium() -> str | None:
    """Install Debian's chromium; None when it is there afterwards, else why not."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine to install Debian's chromium"
    if os.geteuid() != 0:
        return f"not root: cannot run `apt-get install -y {' '.join(APT_PACKAGES)}`"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *APT_PACKAGES]
    done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:  # stale package lists: update once and try again
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=600)
        done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0 or not CHROMIUM.exists():
        return f"`{' '.join(install)}` failed ({done.returncode}): {(done.stderr or done.stdout)[-600:]}"
    return None


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    """Debian's chromium, installed when missing (one pytest worker at a time: apt holds a lock of its own)."""
    if not CHROMIUM.exists():
        with open(INSTALL_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            reason = None if CHROMIUM.exists() else _install_chromium()
        if reason is not None:
            pytest.skip(reason)
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium per test module (each test opens its own context: fresh storage, no shared
    sessionStorage or cache). Not per session: Playwright's sync API keeps an event loop running on the main
    thread while it is open, and a later test of the same pytest worker that calls `asyncio.run` would fail."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]' (it is a dev extra)"
    )
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(chromium_path), headless=True, args=LAUNCH_ARGS)
        try:
            yield launched
        finally:
            launched.close()
