"""The HTTP API's parts, wired together by `service.app.create_app`.

`deps` (the app's services, the caller's tenant, the rate limit), `errors` (every error as JSON),
`limits` (body size, token buckets), `metrics` (Prometheus text), `schemas` (responses and the
non-job bodies), and one router per resource: `jobs`, `traces`, `registry`, `ops`. A job's
request is `service.requests.PlanRequest`, the model the worker reads it back with.
"""
