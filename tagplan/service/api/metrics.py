"""`/metrics` in the Prometheus text exposition format (0.0.4), written by hand.

Job gauges come from the database (every worker and API process shares it); request counters
are per API process, counted by an ASGI middleware under the route's template (`/v1/jobs/{id}`),
so the label set stays bounded whatever paths clients send.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import sqlalchemy as sa
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tagplan.service import db
from tagplan.service.vocabulary import JobStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UNMATCHED = "unmatched"


class RequestCounter:
    """HTTP answers by (route template, status code); thread-safe."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()

    def add(self, route: str, code: int) -> None:
        """Count one answer."""
        with self._lock:
            self._counts[(route, code)] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        """A copy of the counts."""
        with self._lock:
            return dict(self._counts)


class CountRequests:
    """ASGI middleware feeding a `RequestCounter`; an exception counts as a 500 and propagates.

    The route is the one the router put in the scope, else the first of `routes` that matches
    (plain Starlette routes such as /openapi.json leave none), else `unmatched`.
    """

    def __init__(self, app: ASGIApp, counter: RequestCounter, routes: Sequence[BaseRoute] = ()) -> None:
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


def render(jobs: Mapping[str, int] | None, requests: Mapping[tuple[str, int], int],
           durations: tuple[float, int] | None) -> str:
    """The exposition text of the service's metrics (the job families only where `jobs` and
    `durations` are given: an admin's view)."""
    answered = ((f'route="{_escape(route)}",code="{code}"', n) for (route, code), n in sorted(requests.items()))
    lines = _family("tagplan_http_requests_total", "counter", "HTTP requests answered, by route template and code.",
                    answered)
    if jobs is not None:
        lines += [*_family("tagplan_jobs", "gauge", "Jobs by status.",
                           ((f'status="{s}"', jobs.get(s, 0)) for s in sorted({*map(str, JobStatus), *jobs}))),
                  *_family("tagplan_queue_depth", "gauge", "Jobs waiting for a worker.",
                           [("", jobs.get(JobStatus.QUEUED, 0))])]
    if durations is not None:
        total, count = durations
        lines += ["# HELP tagplan_job_duration_seconds Seconds from start to finish of finished jobs.",
                  "# TYPE tagplan_job_duration_seconds summary",
                  f"tagplan_job_duration_seconds_sum {total!r}", f"tagplan_job_duration_seconds_count {count}"]
    return "\n".join(lines) + "\n"


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, int]]) -> list[str]:
    rows = [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *rows]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
