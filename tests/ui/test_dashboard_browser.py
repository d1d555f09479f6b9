"""The dashboard in a real browser during a live run: a real coordinator process, two real islands training a
tiny 2x2 model, and headless Chromium reading /ui/.

Checks, each kept as a screenshot (1280x800) under the test's tmp dir (the path is printed):
  without a token the page shows only the prompt, asks the API nothing and shows no data; a wrong token is
  refused with the server's reason; with the token (URL fragment, removed from the address bar at once) the page
  shows the run, a loss plot with one line per path, labelled axes and a legend, that gains points as rounds
  apply (no reload), the islands with their current lease, and a refused upload's reason among the events; once
  the run is over, each module's weight norm and each training island's measured tokens/s, tokens and bytes up.
Throughout: every request goes to the coordinator only, none carries the token in its URL, no console errors
(CSP violations included).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.client import CoordinatorClient, RequestRejected, RetryPolicy
from coordinator.schemas import IslandCapabilities
from tests.conftest import ADMIN, JOIN
from tests.integration.conftest import Cluster, create_run, wait_finished

pytestmark = pytest.mark.integration

SPEC = {
    "name": "browser-2x2",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 0, "lr": 0.01},
    "inner_steps": 3,
    "num_rounds": 3,
    "lease_ttl_s": 120,  # the prober holds its lease without heartbeats while the page is checked
}
VIEWPORT = {"width": 1280, "height": 800}
WAIT_MS = 60_000


class Shots:
    """Screenshots of the checks, numbered in order."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.taken: list[Path] = []

    def __call__(self, page: Any, name: str, *, full_page: bool = False) -> Path:
        path = self.folder / f"{len(self.taken) + 1:02d}-{name}.png"
        page.screenshot(path=str(path), full_page=full_page)
        self.taken.append(path)
        print(f"screenshot: {path}")
        return path


def _watch(page: Any, seen: dict[str, list[str]]) -> None:
    """Collect every request, every failed reply and every console error (CSP violations among them)."""
    page.on("request", lambda request: seen["requests"].append(request.url))
    page.on("response", lambda r: seen["failed"].append(f"{r.status} {r.url}") if r.status >= 400 else None)

    def console(msg: Any) -> None:
        # a failed reply is also logged as "Failed to load resource"; those are judged by their status above
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            seen["console"].append(msg.text)

    page.on("console", console)
    page.on("pageerror", lambda exc: seen["console"].append(f"pageerror: {exc}"))


def _data_rows(page: Any) -> int:
    return int(
        page.evaluate(
            "() => ['runs','timeline','modules','paths','islands','events']"
            ".map(id => document.getElementById(id).tBodies[0].rows.length).reduce((a, b) => a + b, 0)"
        )
    )


COLUMN_JS = """([table, header]) => {
    const t = document.getElementById(table);
    const at = [...t.tHead.rows[0].cells].findIndex((th) => th.textContent.trim() === header);
    return at < 0 ? [] : [...t.tBodies[0].rows].map((r) => [r.cells[1].innerText, r.cells[at].innerText]);
}"""
"""Table `table`'s cells under the column headed `header`, each with its row's second cell (a name, an index)."""


def _column(page: Any, table: str, header: str) -> list[tuple[str, str]]:
    return [(key, cell) for key, cell in page.evaluate(COLUMN_JS, [table, header])]


def _number(text: str) -> float:
    return float(text.replace(",", "").split()[0])


def _chart(page: Any) -> dict[str, int]:
    return {
        k: int(v)
        for k, v in page.evaluate("() => ({...document.getElementById('loss-chart').dataset})").items()
        if k in ("paths", "points", "rounds")
    }


def test_dashboard_during_a_live_run(browser: Any, tmp_path: Path) -> None:
    started = time.monotonic()
    shots = Shots(tmp_path / "screenshots")
    cluster = Cluster(tmp=tmp_path, database_url=f"sqlite:///{tmp_path / 'registry.db'}")
    seen: dict[str, list[str]] = {"requests": [], "failed": [], "console": []}
    prober: CoordinatorClient | None = None
    try:
        cluster.start_coordinator()
        ui = f"{cluster.url}/ui/"
        # The run first, and a prober island (the typed client) on one of its paths before any real island is
        # there: it has an upload refused and holds the path until the page has shown round 0 waiting for it.
        with cluster.admin() as admin_http:
            run_id = create_run(admin_http, SPEC)
            admin = CoordinatorClient(cluster.url, ADMIN, http=admin_http)
            for p in range(4):  # held-out slices: the islands score each round's start weights on them
                held = np.random.default_rng(10 + p).integers(32 + 10 * p, 48 + 10 * p, 200).astype("<u2")
                admin.register_heldout(run_id, p, held.tobytes(), num_documents=1)
        prober = CoordinatorClient(cluster.url, JOIN, retry=RetryPolicy.once())
        prober.join("prober", site="test-bench", capabilities=IslandCapabilities(tokens_per_s=1234.0))
        lease = prober.lease()
        assert lease is not None, "the prober found no free path"
        with pytest.raises(RequestRejected) as refused:
            prober.upload(lease, b"this is not a safetensors file", tokens=10, train_loss=3.0)
        assert refused.value.status == 422
        reason = refused.value.detail
        cluster.start_island("island-a", "--no-probe")  # they train the other three paths of round 0
        cluster.start_island("island-b", "--no-probe")

        # 1. no token: only the prompt, no request for data, no data
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        _watch(page, seen)
        page.goto(ui)
        page.wait_for_selector("#login", state="visible")
        assert page.is_hidden("#dashboard")
        assert _data_rows(page) == 0
        assert not [u for u in seen["requests"] if "/v1/" in u]
        shots(page, "no-token")

        # 2. a wrong token: refused with the server's reason, still no data
        page.fill("#token-input", "not-a-token-of-this-coordinator")
        page.click("#login-form button[type=submit]")
        page.wait_for_function("() => document.getElementById('login-error').textContent.includes('unknown token')")
        assert page.is_hidden("#dashboard") and _data_rows(page) == 0
        shots(page, "wrong-token")
        context.close()
        assert seen["failed"] and all(f.startswith("401 ") for f in seen["failed"]), seen["failed"]
        seen["failed"].clear()

        # 3. the token in the URL fragment: the page reads it, drops it from the address bar, shows the run
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        _watch(page, seen)
        page.goto(f"{ui}#token={ADMIN}")
        page.wait_for_selector(f"#runs tbody tr[data-run='{run_id}']", timeout=WAIT_MS)
        assert "token" not in page.url and ADMIN not in page.url
        row = page.inner_text(f"#runs tbody tr[data-run='{run_id}']")
        assert "browser-2x2" in row and "0 / 3" in row

        # 4. the loss plot: a line per path, labelled axes, a legend; round 0 waits for the prober's path
        page.wait_for_function(
            "() => Number(document.getElementById('loss-chart').dataset.points) >= 3", timeout=WAIT_MS
        )
        first = _chart(page)
        assert first == {"paths": 4, "rounds": 1, "points": 3}
        legend = page.eval_on_selector_all("#loss-chart .u-legend .u-series th", "ths => ths.map(t => t.innerText)")
        paths = [f"path {p}" for p in range(4)]
        assert [label.strip() for label in legend] == ["round", *paths, *(f"{p} held-out" for p in paths)]
        axes = page.evaluate("() => JSON.parse(document.getElementById('loss-chart').dataset.axes)")
        assert axes == ["round", "loss (nats/token)"]  # drawn on the canvas (see the screenshots)
        held_out = int(page.evaluate("() => document.getElementById('loss-chart').dataset.heldoutPoints"))
        assert held_out == 3 and page.is_visible("#heldout-note") and page.is_hidden("#perplexity-note")
        assert page.locator("#loss-chart canvas").count() == 1
        assert "3 / 4" in page.inner_text("#timeline tbody tr[data-round='0']")
        page.wait_for_function(
            f"() => document.getElementById('islands').innerText.includes('round 0 · path {lease.path_index}')",
            timeout=WAIT_MS,
        )
        shots(page, "round-0-waits-for-a-path")
        prober_row = page.locator("#islands tbody tr", has_text="prober")
        assert f"run {run_id} · round 0 · path {lease.path_index}" in prober_row.inner_text()
        page.locator("#islands-section").scroll_into_view_if_needed()
        shots(page, "islands-while-the-prober-holds-a-path")

        # ... the prober gives its path back: the islands finish round 0 and the next ones; the plot gains points
        prober.release(lease.lease_id)
        page.wait_for_function(
            f"() => Number(document.getElementById('loss-chart').dataset.points) > {first['points']}", timeout=WAIT_MS
        )
        later = _chart(page)
        assert later["rounds"] > first["rounds"] and later["points"] > first["points"]
        shots(page, "loss-plot-gains-points")
        with cluster.admin() as admin_http:
            CoordinatorClient(cluster.url, ADMIN, http=admin_http).revoke_island(prober.island_id or 0)

        # 5. the islands, with their site and what they do
        page.wait_for_selector("#islands tbody tr[data-island]", timeout=WAIT_MS)
        islands = page.inner_text("#islands")
        assert "island-a" in islands and "island-b" in islands and "prober" in islands and "test-bench" in islands
        page.wait_for_selector("#islands tbody tr td.status-revoked", timeout=WAIT_MS)
        page.locator("#islands-section").scroll_into_view_if_needed()
        shots(page, "islands")

        # 6. the refused upload and its reason
        page.wait_for_selector("#events tbody tr[data-kind='upload_refused']", timeout=WAIT_MS)
        event = page.inner_text("#events tbody tr[data-kind='upload_refused']")
        assert reason in event and "upload refused" in event
        assert reason.startswith("outer-gradient payload")
        page.wait_for_selector("#events tbody tr[data-kind='island_revoked']", timeout=WAIT_MS)
        page.locator("#events-section").scroll_into_view_if_needed()
        shots(page, "refused-upload")

        # 7. the run finishes; the page follows without a reload (the finished run is still browsable)
        with cluster.admin() as admin_http:
            wait_finished(cluster, admin_http, run_id, timeout_s=120)
        page.wait_for_function(
            "() => Number(document.getElementById('loss-chart').dataset.rounds) === 3", timeout=WAIT_MS
        )
        page.wait_for_selector(f"#runs tbody tr[data-run='{run_id}'] td.status-finished", timeout=WAIT_MS)
        assert _chart(page)["points"] == 12
        assert page.locator("#timeline tbody tr").count() == 3
        page.evaluate("() => window.scrollTo(0, 0)")
        shots(page, "finished-run")
        shots(page, "finished-run-full-page", full_page=True)

        # ... each module's weight norm, and what each island trained, measured by the coordinator
        norms = [cell for _, cell in _column(page, "modules", "weight norm")]
        assert len(norms) == 6 and all(_number(norm) > 0 for norm in norms), norms
        page.wait_for_function(
            f"() => {{ const c = Object.fromEntries(({COLUMN_JS})(['islands', 'tokens trained']));"
            " return ['island-a', 'island-b'].every((n) => Number((c[n] || '0').replace(/,/g, '')) > 0); }",
            timeout=WAIT_MS,
        )
        trained = dict(_column(page, "islands", "tokens trained"))
        speed = dict(_column(page, "islands", "tokens/s"))
        sent = dict(_column(page, "islands", "bytes up"))
        for name in ("island-a", "island-b"):
            assert _number(trained[name]) > 0 and _number(speed[name]) > 0, (trained, speed)
            assert "(probe)" not in speed[name]  # measured, not the probe's (--no-probe: there is none)
            assert sent[name].endswith("B") and _number(sent[name]) > 0, sent
        # the prober's upload was refused: no contribution, so its join probe's tokens/s, labelled as such
        assert _number(trained["prober"]) == 0 and sent["prober"] == "0 B" and speed["prober"] == "1,234 (probe)"
        page.locator("#modules").scroll_into_view_if_needed()
        shots(page, "module-weight-norms")
        page.locator("#islands-section").scroll_into_view_if_needed()
        shots(page, "islands-measured")

        # 8. forgetting the token takes the data off the page
        page.click("#sign-out")
        page.wait_for_selector("#login", state="visible")
        assert _data_rows(page) == 0 and page.is_hidden("#dashboard")
        context.close()

        other = [u for u in seen["requests"] if not u.startswith(cluster.url + "/")]
        assert not other, f"requests to other origins: {other}"
        leaked = [u for u in seen["requests"] if ADMIN in u.split("#")[0]]
        assert not leaked, f"the token travelled in a URL: {leaked}"
        assert not seen["failed"], seen["failed"]
        assert not seen["console"], seen["console"]
    finally:
        if prober is not None:
            prober.close()
        cluster.stop()
        print(f"screenshots in {shots.folder}; dashboard test took {time.monotonic() - started:.1f} s")
