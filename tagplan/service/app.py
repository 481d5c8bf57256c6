"""The HTTP API: `create_app(settings)` builds the FastAPI app of docs/SERVICE.md.

Routes live in one module per resource (`api.jobs`, `api.traces`, `api.registry`, `api.ops`);
this module wires them to the database, the limits, the error handlers and the web view.
Long work never runs here: a request validates, queues a job, and a worker process runs it.

    uvicorn.run(create_app(settings), host="127.0.0.1", port=8000)
    uvicorn --factory tagplan.service.app:create_app     # settings from the environment
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from tagplan import __version__
from tagplan.service.api import errors, jobs, ops, registry, traces
from tagplan.service.api.deps import Services
from tagplan.service.api.limits import BodySizeLimit, RateLimiter
from tagplan.service.api.metrics import CountRequests, JobMetrics, ServiceMetrics, job_durations
from tagplan.service.api.schemas import SafeJSONResponse
from tagplan.service.db import make_engine
from tagplan.service.settings import Settings, get_settings, private_files
from tagplan.service.store import JobStore

WEB_DIR = Path(__file__).resolve().parent / "web"
DESCRIPTION = """Plans for distributed training as a shared service. Submit a model and a cluster
(`POST /v1/plans`), follow the job (`GET /v1/jobs/{id}`, or its server-sent `events`), fetch the
result. Every `/v1` route needs an API key: `Authorization: Bearer <key>` or `X-API-Key: <key>`."""
_FALLBACK_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>tagplan</title></head>
<body><h1>tagplan planning service</h1><p>The web view is not installed. See the API at
<a href="/docs">/docs</a> (OpenAPI: <a href="/openapi.json">/openapi.json</a>).</p></body></html>"""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service's app on `settings` (default: `get_settings()`, the environment's); migrates the
    database to the newest schema first (`db.migrate`)."""
    settings = settings or get_settings()
    private_files()  # `uvicorn --factory` starts here: the database and uploads are the service owner's alone
    engine = make_engine(settings.database_url, timeout_s=settings.db_timeout_s)
    store = JobStore(engine, settings)
    metrics = ServiceMetrics(JobMetrics(store.counts, lambda: job_durations(engine)))
    services = Services(settings=settings, engine=engine, store=store, limiter=RateLimiter(settings.rate_per_minute),
                        metrics=metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.dispose()

    app = FastAPI(title="tagplan planning service", version=__version__, description=DESCRIPTION,
                  default_response_class=SafeJSONResponse, lifespan=lifespan)
    app.state.services = services
    errors.install(app)
    for module in (jobs, traces, registry, ops):
        app.include_router(module.router)
    _add_web(app)
    _document_bodies(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Outermost: it counts the 413s too.
    app.add_middleware(CountRequests, counter=services.metrics, routes=app.router.routes)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Document the bodies validated outside FastAPI's own parsing (`jobs.document_plan_bodies`)."""
    built = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = built()
            jobs.document_plan_bodies(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_web(app: FastAPI) -> None:
    """The web view: `web/index.html` at `/`, the directory at `/static` (a pointer to /docs without it)."""
    if WEB_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        page = WEB_DIR / "index.html"
        return FileResponse(page, media_type="text/html") if page.is_file() else HTMLResponse(_FALLBACK_PAGE)
