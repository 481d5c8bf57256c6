"""Request limits (`service/api/limits.py`): the body size and the per-tenant rate of submissions."""

from __future__ import annotations

from typing import Any

from tagplan.service.api.limits import RateLimiter, retry_after


def test_oversized_body_is_413(make_settings: Any, keys: Any, api: Any) -> None:
    with api.client_for(make_settings(max_body_bytes=1000)) as client:
        big = {**api.TINY, "model": "x" * 2000}
        answer = client.post("/v1/plans", json=big, headers=api.auth(keys.a))
        assert answer.status_code == 413 and "1000 bytes" in answer.json()["detail"]
        streamed = client.post("/v1/traces", content=iter([b"x" * 600, b"y" * 600]),
                               headers={**api.auth(keys.a), "Content-Type": "text/plain"})
        assert streamed.status_code == 413
        assert client.post("/v1/plans", json=api.TINY, headers=api.auth(keys.a)).status_code == 202


def test_rate_limit_is_429_with_retry_after(make_settings: Any, keys: Any, api: Any) -> None:
    with api.client_for(make_settings(rate_per_minute=3)) as client:
        for _ in range(3):
            api.submit(client, keys.a)
        limited = client.post("/v1/plans", json=api.TINY, headers=api.auth(keys.a))
        assert limited.status_code == 429
        assert int(limited.headers["Retry-After"]) >= 1
        assert "3 submissions per minute" in limited.json()["detail"]
        api.submit(client, keys.b)  # another tenant has its own bucket


def test_token_bucket_refills() -> None:
    now = [0.0]
    limiter = RateLimiter(2, clock=lambda: now[0])
    assert (limiter.take("a"), limiter.take("a")) == (0.0, 0.0)
    assert limiter.take("a") == 30.0 and limiter.take("b") == 0.0
    now[0] = 30.0
    assert limiter.take("a") == 0.0
    assert retry_after(0.2) == "1" and RateLimiter(0).take("a") == 0.0
