"""Request limits: the body size (an ASGI middleware) and a per-tenant token bucket on submissions."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """Answers 413 when a request's body is larger than `max_bytes`.

    A declared `Content-Length` over the limit is refused before anything is read; otherwise the
    body is read here (at most `max_bytes`, so chunked uploads are bounded too) and replayed to
    the app, which therefore never sees more than the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending the body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body larger than the limit of {self.max_bytes} bytes (TAGPLAN_MAX_BODY_BYTES)"
        await JSONResponse({"detail": detail}, status_code=413, headers={"Connection": "close"})(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out `body` once, then defers to the real one (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """A token bucket per key: `per_minute` tokens, refilled continuously; thread-safe.

    In memory, so each API process limits on its own; `per_minute <= 0` turns the limit off.
    """

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: dict[object, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, key: object) -> float:
        """Spend one token of `key`'s bucket: 0.0 if allowed, else the seconds until a token is back."""
        if self.per_minute <= 0:
            return 0.0
        rate_per_s = self.per_minute / 60.0
        with self._lock:
            now = self._clock()
            bucket = self._buckets.setdefault(key, _Bucket(float(self.per_minute), now))
            bucket.tokens = min(float(self.per_minute), bucket.tokens + (now - bucket.updated) * rate_per_s)
            bucket.updated = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return 0.0
            return (1.0 - bucket.tokens) / rate_per_s


def retry_after(wait_s: float) -> str:
    """The `Retry-After` header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(wait_s)))
