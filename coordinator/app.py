"""The coordinator's FastAPI application: `create_app(settings)`; the lifespan owns engine, blob store and the
background sweeper (lease expiry, deadline closes)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from coordinator import db
from coordinator.api import routes
from coordinator.api.deps import AppState
from coordinator.api.guard import RequestGuard
from coordinator.api.spool import SpoolError, process_spool
from coordinator.auth import IslandTokenCache, ensure_private_dir, load_service_tokens
from coordinator.batching import GroupCommit
from coordinator.blobstore import BlobError, S3BlobStore, open_blob_store
from coordinator.errors import ServiceError
from coordinator.faults import FaultInjector
from coordinator.metrics import Metrics
from coordinator.offer_book import OfferBook
from coordinator.services import islands
from coordinator.services.apply import ApplyExecutor, executor_name, release_claims, release_dead_claims
from coordinator.services.closing import RoundCloser
from coordinator.services.direct import DirectLimits
from coordinator.services.dispatch import LeaseDispatcher
from coordinator.services.leases import Affinity
from coordinator.services.staging import sweep_staging
from coordinator.services.uploads import UploadDesk
from coordinator.settings import Settings
from coordinator.timeutil import utcnow
from coordinator.timing import ServerTiming
from coordinator.wakeups import WorkSignal

log = logging.getLogger(__name__)


def build_state(settings: Settings, *, clock: Callable[[], datetime] = utcnow) -> AppState:
    """Migrate, connect, open the blob store, and wire the services that hold per-process state."""
    ensure_private_dir(settings.data_dir)
    url = settings.resolved_database_url
    if settings.migrate_on_start:
        db.upgrade(url)
    engine = db.make_engine(url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow)
    sessions = db.make_sessionmaker(engine)
    blobs = open_blob_store(settings.resolved_blob_url, s3_endpoint_url=settings.s3_endpoint_url)
    spool = process_spool(settings.data_dir.resolve() / "spool")
    metrics = Metrics()
    faults = FaultInjector(pause_at=settings.fault_pause_at, marker_dir=settings.data_dir.resolve())
    # paths stay with the island that trained them (offers, reservations)
    affinity = Affinity(reserve_s=settings.path_reservation_s, live_s=3 * settings.heartbeat_interval_s)
    wakeups, offers = WorkSignal(), OfferBook()
    closer = RoundCloser(metrics=metrics, offers=offers, wakeups=wakeups)

    def beat(island_ids: list[int]) -> list[list[int]]:
        with sessions() as session:
            extended = islands.heartbeats(session, island_ids, now=clock())
        return [extended[island_id] for island_id in island_ids]

    return AppState(
        settings=settings,
        engine=engine,
        sessions=sessions,
        blobs=blobs,
        tokens=load_service_tokens(settings),
        clock=clock,
        spool_dir=spool,
        metrics=metrics,
        faults=faults,
        island_tokens=IslandTokenCache(settings.auth_cache_s),
        wakeups=wakeups,
        offers=offers,
        closer=closer,
        dispatcher=LeaseDispatcher(
            sessions=sessions,
            clock=clock,
            closer=closer,
            offers=offers,
            wakeups=wakeups,
            metrics=metrics,
            affinity=affinity,
            max_leases=settings.max_leases_per_island,
            direct=blobs if isinstance(blobs, S3BlobStore) else None,
            presign_expiry_s=settings.presign_expiry_s,
        ),
        heartbeats=GroupCommit(beat),
        uploads=UploadDesk(
            sessions=sessions,
            blobs=blobs,
            clock=clock,
            closer=closer,
            metrics=metrics,
            faults=faults,
            max_upload_bytes=settings.max_upload_bytes,
            affinity=affinity,
            max_leases=settings.max_leases_per_island,
            direct=DirectLimits(
                multipart_bytes=settings.direct_multipart_bytes,
                part_bytes=settings.direct_part_bytes,
                expiry_s=settings.presign_expiry_s,
            ),
        ),
    )


def start_executors(state: AppState, stop: threading.Event) -> list[threading.Thread]:
    """`settings.apply_workers` apply executors on threads of this process (see services/apply.py)."""
    threads = []
    for index in range(state.settings.apply_workers):
        executor = ApplyExecutor(
            sessions=state.sessions,
            blobs=state.blobs,
            clock=state.clock,
            name=executor_name(index),
            faults=state.faults,
            affinity=state.dispatcher.affinity,
            claim_s=state.settings.apply_claim_s,
            on_step=lambda done: state.closer.stepped(done, now=state.clock()),
            handed=state.closer.take_handed if index == 0 else None,
        )
        if index == 0:  # uploads claim the steps they make due for it (`periods.make_due`)
            state.closer.claimer = executor.name
        thread = threading.Thread(
            target=executor.serve,
            args=(stop, state.closer.executors_wake),
            kwargs={"poll_s": state.settings.sweep_interval_s},
            name=f"dipaco-apply-{index}",
            daemon=True,
        )
        thread.start()
        threads.append(thread)
    return threads


async def _sweeper(state: AppState) -> None:
    """Every `sweep_interval_s`: expire leases, close rounds past their deadline; every `staging_sweep_s` (the
    first time at start-up): remove staged uploads nothing will read (`staging.sweep_staging`)."""
    staging_swept = -math.inf
    while True:
        await asyncio.sleep(state.settings.sweep_interval_s)
        try:
            await run_in_threadpool(state.dispatcher.sweep)
        except Exception:  # keep sweeping: the next pass retries whatever failed
            log.exception("background sweep failed")
        every = state.settings.staging_sweep_s
        if every > 0 and time.monotonic() - staging_swept >= every:
            staging_swept = time.monotonic()
            try:
                await run_in_threadpool(_sweep_staging, state)
            except Exception:
                log.exception("staging sweep failed")


def _sweep_staging(state: AppState) -> int:
    with state.sessions() as session:
        return sweep_staging(session, state.blobs, now=state.clock(), grace_s=state.settings.staging_grace_s)


def quiet_garbage_collector() -> None:
    """Keep Python's full collections from stalling every request for a few hundred ms (`serve` calls this once
    the app is built; tests, which build many apps in one process, do not).

    After the imports (torch, numpy, SQLAlchemy, FastAPI: ~350k objects) the objects alive are moved out of the
    collector's reach (`gc.freeze`): they live as long as the process. The young generation is also collected
    less often (5000 allocations instead of 700) and a full pass runs after 100 middle-generation passes instead
    of 10. Measured with 256 simulated islands: full passes took 220-436 ms each before, 55-142 ms (every ~20 s)
    with the freeze alone, and none ran in the 140 s run with both; middle passes stay under 30 ms.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(5000, 10, 100)


def create_app(settings: Settings, *, clock: Callable[[], datetime] = utcnow) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(settings, clock=clock)
        state.wakeups.bind(asyncio.get_running_loop())
        app.state.dipaco = state
        if state.tokens.generated_file is not None:
            log.info("admin and join tokens are in %s", state.tokens.generated_file)
        with state.sessions() as session:
            release_dead_claims(session)  # steps a killed process of this host was applying
            recovered = state.closer.close_ready(session, None, now=clock())
            if recovered:
                log.info("closed %d complete round(s) left over from before a restart", recovered)
        stop = threading.Event()
        executors = start_executors(state, stop)
        sweeper = asyncio.create_task(_sweeper(state))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            claimer, state.closer.claimer = state.closer.claimer, None  # no more hand-overs
            stop.set()
            state.closer.executors_wake.set()
            for thread in executors:
                await asyncio.to_thread(thread.join, 30)
            if claimer is not None:  # the steps handed over and not taken up go back to the pool
                with state.sessions() as session:
                    while handed := state.closer.take_handed():
                        release_claims(session, handed, claimer)
            state.engine.dispose()

    app = FastAPI(
        title="dipaco coordinator",
        description="Registry and round protocol for DiPaCo / DiLoCo training across islands.",
        version="0.1.0",
        lifespan=lifespan,
    )

    app.add_middleware(RequestGuard)  # authenticate from the headers, cap JSON bodies
    app.add_middleware(ServerTiming)  # outermost: its time includes the guard's

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail})

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": json_safe_errors(exc.errors())})

    @app.exception_handler(BlobError)
    async def _blob_error(_: Request, exc: BlobError) -> JSONResponse:
        log.error("blob store: %s", exc)
        return JSONResponse(status_code=500, content={"detail": f"blob store: {exc}"})

    @app.exception_handler(SpoolError)
    async def _spool_error(_: Request, exc: SpoolError) -> JSONResponse:
        log.error("%s", exc)
        return JSONResponse(status_code=500, content={"detail": f"the coordinator could not store the body: {exc}"})

    for module in (routes.health, routes.runs, routes.registry, routes.islands, routes.leases):
        app.include_router(module.router)
    app.include_router(routes.dashboard.router)  # reads for watching a run
    app.include_router(routes.ui.router)  # the web dashboard's files at /ui/
    return app


def json_safe_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Request validation errors as FastAPI reports them (`loc`, `msg`, `type`, `input`, `ctx`), with any value
    JSON cannot carry (an `inf` parsed from 1e309, bytes, ...) replaced by its repr: FastAPI's own handler would
    fail to encode the reply and answer 500 instead of 422."""
    safe: list[dict[str, Any]] = []
    for error in errors:
        entry: dict[str, Any] = {}
        for key, value in dict(error).items():
            try:
                json.dumps(value, allow_nan=False)
                entry[key] = value
            except (TypeError, ValueError):
                entry[key] = repr(value)
        safe.append(entry)
    return safe


def create_app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` with several workers: settings come from the DIPACO_* environment."""
    settings = Settings()
    app = create_app(settings)
    quiet_garbage_collector()
    use_torch_threads(settings)
    return app


def use_torch_threads(settings: Settings) -> None:
    """Set this process's torch intra-op threads (`Settings.torch_threads`): called by `serve` and `apply-worker`,
    not by `create_app`, so that an app built in a test leaves the test process as it was."""
    import torch

    torch.set_num_threads(settings.torch_threads)
