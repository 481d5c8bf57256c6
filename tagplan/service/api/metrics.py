"""`/metrics` in the Prometheus text format, with `prometheus_client` on registries of the app's own.

`ServiceMetrics` holds two `CollectorRegistry`s per app (never the process-global one, so two apps
in one process, as in the tests, count apart): `public` has the HTTP request counter, labelled
by the route's template (`/v1/jobs/{job_id}`, counted by the `CountRequests` middleware) so the
label set stays bounded whatever paths clients send; `admin` adds the job families (`JobMetrics`),
read from the database at scrape time (every worker and API process shares it). Request counts
are per API process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tagplan.service import db
from tagplan.service.vocabulary import JobStatus

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
UNMATCHED = "unmatched"


class JobMetrics(Collector):
    """Jobs by status, the queue's depth and finished jobs' durations, read when scraped."""

    def __init__(self, counts: Callable[[], Mapping[str, int]], durations: Callable[[], tuple[float, int]]) -> None:
        self._counts, self._durations = counts, durations

    def describe(self) -> Iterator[Metric]:
        """The families without samples (so registering reads no database)."""
        yield GaugeMetricFamily("tagplan_jobs", "Jobs by status.", labels=["status"])
        yield GaugeMetricFamily("tagplan_queue_depth", "Jobs waiting for a worker.")
        yield SummaryMetricFamily("tagplan_job_duration_seconds", "Seconds from start to finish of finished jobs.")

    def collect(self) -> Iterator[Metric]:
        """`tagplan_jobs{status}` (every `JobStatus`), `tagplan_queue_depth`, `tagplan_job_duration_seconds`."""
        counts = self._counts()
        jobs = GaugeMetricFamily("tagplan_jobs", "Jobs by status.", labels=["status"])
        for status in sorted({*map(str, JobStatus), *counts}):
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        yield GaugeMetricFamily("tagplan_queue_depth", "Jobs waiting for a worker.",
                                value=counts.get(JobStatus.QUEUED, 0))
        total_s, count = self._durations()
        yield SummaryMetricFamily("tagplan_job_duration_seconds", "Seconds from start to finish of finished jobs.",
                                  count_value=count, sum_value=total_s)


class ServiceMetrics:
    """One app's metrics: `public` (HTTP answers by route template and code) and `admin` (those and
    `JobMetrics`); thread-safe (prometheus_client's counters are)."""

    def __init__(self, jobs: JobMetrics | None = None) -> None:
        self.public = CollectorRegistry(auto_describe=True)
        self.admin = CollectorRegistry(auto_describe=True)
        self._requests = Counter("tagplan_http_requests", "HTTP requests answered, by route template and code.",
                                 ["route", "code"], registry=self.public)
        self.admin.register(self._requests)
        if jobs is not None:
            self.admin.register(jobs)

    def add(self, route: str, code: int) -> None:
        """Count one answer."""
        self._requests.labels(route=route, code=str(code)).inc()

    def exposition(self, *, admin: bool) -> bytes:
        """The text format of `admin` (an admin key's view) or `public`."""
        return generate_latest(self.admin if admin else self.public)


class CountRequests:
    """ASGI middleware feeding a `ServiceMetrics`; an exception counts as a 500 and propagates.

    The route is the one the router put in the scope, else the first of `routes` that matches
    (plain Starlette routes such as /openapi.json leave none), else `unmatched`.
    """

    def __init__(self, app: ASGIApp, counter: ServiceMetrics, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.counter = counter
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self.counter.add(self._route(scope), status)

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] is Match.FULL), None)
        return str(getattr(route, "path", UNMATCHED))


def job_durations(engine: sa.Engine) -> tuple[float, int]:
    """(total seconds, count) from start to finish over the finished jobs."""
    job = db.Job
    query = sa.select(job.started_at, job.finished_at).where(job.started_at.is_not(None),
                                                              job.finished_at.is_not(None))
    total, count = 0.0, 0
    with engine.connect() as conn:
        for started, finished in conn.execute(query):
            if started is not None and finished is not None:  # the WHERE says so; mypy cannot know
                total += max(0.0, (finished - started).total_seconds())
                count += 1
    return total, count
