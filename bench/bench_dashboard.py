"""What one open dashboard page costs the coordinator, on a run with 16 paths and 16 islands.

  python bench/bench_dashboard.py [--islands 16] [--paths 16] [--phase-s 45] [--database sqlite|postgres]

A coordinator process, a 4x4 run (16 paths) of the tiny debug model and 16 simulated islands (asyncio tasks
speaking the wire protocol: long-polled leases, a heartbeat every 10 s, 2 s of "training" per lease, a valid
upload). Three phases of `--phase-s` each: no page, one dashboard page open in headless Chromium (Debian's, via
Playwright, token in the URL fragment), no page again. Reported: the page's requests per second (by endpoint),
the bytes it read, the coordinator's own time on them (Server-Timing) and the coordinator's CPU seconds per
minute with and without the page (the difference is what the page adds; the baseline is the mean of the two
page-less phases). Everything shares the machine's cores, so CPU numbers are the coordinator process's only
(/proc/<pid>/stat). At the end, with the islands stopped, one poll's requests are replayed `--polls` times in a
row: the coordinator's CPU per poll measured alone, without the noise of 16 islands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_coordinator import (  # noqa: E402
    ADMIN,
    HEARTBEAT_S,
    JOIN,
    LEASE_WAIT_S,
    create_debug_run,
    drop_pg,
    grads_for,
    pg_database,
    process_cpu_s,
    start_coordinator,
)

from coordinator.client import CoordinatorClient  # noqa: E402
from coordinator.schemas import H_ROUND, H_TOKENS, H_TRAIN_LOSS  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
TRAIN_S = 2.0


async def islands(url: str, joined: list[Any], payload: bytes, stop: list[bool], counts: Counter[str]) -> None:
    """Simulated islands until `stop[0]`: lease (long poll), "train", upload; heartbeats in the background."""
    rng = random.Random(0)

    async def heartbeats(client: httpx.AsyncClient, iid: int, h: dict[str, str]) -> None:
        await asyncio.sleep(HEARTBEAT_S * iid / len(joined))
        while not stop[0]:
            await client.post(f"/v1/islands/{iid}/heartbeat", headers=h)
            counts["heartbeat"] += 1
            await asyncio.sleep(HEARTBEAT_S)

    async def island(j: Any) -> None:
        iid, h = j.island_id, {"Authorization": f"Bearer {j.token}"}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            beat = asyncio.create_task(heartbeats(client, iid, h))
            while not stop[0]:
                r = await client.post(f"/v1/islands/{iid}/lease", params={"wait": LEASE_WAIT_S}, headers=h)
                counts["lease"] += 1
                if r.status_code != 200:
                    await asyncio.sleep(float(r.headers.get("Retry-After", "2")))
                    continue
                lease = r.json()
                await asyncio.sleep(TRAIN_S * rng.uniform(0.7, 1.3))
                u = await client.post(
                    f"/v1/leases/{lease['lease_id']}/outer-gradients",
                    content=payload,
                    headers={**h, H_ROUND: str(lease["round"]), H_TOKENS: "1", H_TRAIN_LOSS: str(rng.uniform(2, 5))},
                )
                counts[f"upload {u.status_code}"] += 1
            beat.cancel()

    await asyncio.gather(*(island(j) for j in joined))


def poll_cost(url: str, pid: int, run_id: int, *, polls: int) -> dict[str, float]:
    """The coordinator's CPU per page poll, measured alone: the requests of one steady-state poll (as the page
    sends them, history from its last round on), `polls` times in a row with nothing else running."""
    requests = [
        ("/v1/runs", {"limit": 1000}),
        ("/v1/run-stats", {"limit": 1000}),
        (f"/v1/runs/{run_id}/history", {"offset": 0, "limit": 1000}),
        ("/v1/modules", {"run_id": run_id, "limit": 1000}),
        ("/v1/paths", {"run_id": run_id, "limit": 1000}),
        ("/v1/islands", {"limit": 1000}),
        ("/v1/leases", {"status": "active", "limit": 1000}),
        ("/v1/events", {"after": 0, "order": "desc", "limit": 200}),
    ]
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        last = http.get(f"/v1/runs/{run_id}/history", params={"limit": 1}).json()["count"] - 1
        requests[2] = (f"/v1/runs/{run_id}/history", {"offset": last, "limit": 1000})
        for path, params in requests:  # warm: first-use costs (imports, caches) are not the steady state
            http.get(path, params=params).raise_for_status()
        cpu0, t0 = process_cpu_s(pid), time.perf_counter()
        for _ in range(polls):
            for path, params in requests:
                http.get(path, params=params).raise_for_status()
        cpu1, t1 = process_cpu_s(pid), time.perf_counter()
    return {
        "requests_per_poll": len(requests),
        "cpu_ms_per_poll": round((cpu1 - cpu0) / polls * 1000, 1),
        "cpu_ms_per_request": round((cpu1 - cpu0) / polls / len(requests) * 1000, 2),
        "wall_ms_per_poll": round((t1 - t0) / polls * 1000, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    tmp = Path(tempfile.mkdtemp(prefix="dipaco-dashboard-bench-"))
    database_url = pg_database() if args.database == "postgres" else f"sqlite:///{tmp / 'registry.db'}"
    proc, url = start_coordinator(tmp / "coordinator", database_url)
    try:
        created = create_debug_run(url, "dashboard-bench", paths=args.paths, lease_ttl_s=60)
        with httpx.Client(base_url=url, timeout=30) as http:
            joined = [CoordinatorClient(url, JOIN, http=http).join(f"sim-{i}") for i in range(args.islands)]
        levels = [name.split(":")[0].strip() for name in created.layout.split(",")]
        payload = grads_for(created.config["model"], created.layout, list(enumerate(levels)), seed=0)
        stop = [False]
        counts: Counter[str] = Counter()
        sim = asyncio.create_task(islands(url, joined, payload, stop, counts))
        await asyncio.sleep(args.warmup_s)

        async def phase() -> dict[str, float]:
            cpu0, t0 = process_cpu_s(proc.pid), time.monotonic()
            await asyncio.sleep(args.phase_s)
            cpu1, t1 = process_cpu_s(proc.pid), time.monotonic()
            return {"seconds": t1 - t0, "cpu_s": cpu1 - cpu0, "cpu_s_per_min": (cpu1 - cpu0) / (t1 - t0) * 60}

        before = await phase()
        page_requests: list[tuple[str, int, float, int]] = []  # (endpoint, status, server ms, bytes)
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM,
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            page = await browser.new_page(viewport={"width": 1280, "height": 800})

            async def on_response(response: Any) -> None:
                path = urlparse(response.url).path
                if not path.startswith("/v1/"):
                    return
                timing = (await response.all_headers()).get("server-timing", "").partition("dur=")[2]
                body = await response.body()
                endpoint = "/v1/runs/{id}/history" if path.endswith("/history") else path
                page_requests.append((endpoint, response.status, float(timing or 0), len(body)))

            page.on("response", on_response)
            await page.goto(f"{url}/ui/#token={ADMIN}")
            await page.wait_for_selector("#loss-chart canvas", timeout=60_000)
            page_requests.clear()  # the first load (every round's history) is not the steady state
            with_page = await phase()
            if args.screenshot is not None:
                await page.screenshot(path=str(args.screenshot))
            points = await page.evaluate("() => ({...document.getElementById('loss-chart').dataset})")
            await browser.close()
        after = await phase()
        stop[0] = True
        await sim
        with CoordinatorClient(url, ADMIN) as admin:
            rounds = admin.run(created.id).current_round
        alone = poll_cost(url, proc.pid, created.id, polls=args.polls)
    finally:
        proc.terminate()
        proc.wait()
        if args.database == "postgres":
            drop_pg(database_url)
    baseline = (before["cpu_s_per_min"] + after["cpu_s_per_min"]) / 2
    seconds = with_page["seconds"]
    by_endpoint = Counter(e for e, _, _, _ in page_requests)
    polls_per_min = by_endpoint["/v1/runs"] / seconds * 60
    return {
        "bench": "dashboard",
        "database": args.database,
        "paths": created.num_paths,
        "islands": args.islands,
        "rounds_applied": rounds,
        "phase_s": args.phase_s,
        "page": {
            "requests": len(page_requests),
            "requests_per_s": round(len(page_requests) / seconds, 2),
            "by_endpoint_per_min": {e: round(n / seconds * 60, 1) for e, n in sorted(by_endpoint.items())},
            "server_ms_mean_by_endpoint": {
                e: round(sum(ms for x, _, ms, _ in page_requests if x == e) / n, 1)
                for e, n in sorted(by_endpoint.items())
            },
            "failed": sum(1 for _, status, _, _ in page_requests if status >= 400),
            "kib_per_min": round(sum(b for _, _, _, b in page_requests) / 1024 / seconds * 60, 1),
            "server_ms_per_min": round(sum(ms for _, _, ms, _ in page_requests) / seconds * 60, 1),
            "server_ms_per_request_p50": sorted(ms for _, _, ms, _ in page_requests)[len(page_requests) // 2]
            if page_requests
            else None,
            "chart": points,
        },
        "one_poll_alone": {
            **alone,
            "cpu_s_per_min_at_page_rate": round(alone["cpu_ms_per_poll"] * polls_per_min / 1000, 2),
        },
        "coordinator_cpu_s_per_min": {
            "without_page": round(baseline, 2),
            "with_page": round(with_page["cpu_s_per_min"], 2),
            "added_by_page": round(with_page["cpu_s_per_min"] - baseline, 2),
            "phases": [round(p["cpu_s_per_min"], 2) for p in (before, with_page, after)],
        },
        "island_requests": dict(counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=16)
    parser.add_argument("--paths", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=45.0)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--polls", type=int, default=200, help="polls replayed alone at the end (CPU per poll)")
    parser.add_argument("--screenshot", type=Path, default=None, help="a PNG of the page at the end of its phase")
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
