"""The planning service: an HTTP API over a durable job queue, worked by separate processes.

A request never plans: it validates, stores a job (`store.JobStore`) and answers. Worker processes
(`worker.run_worker`) claim jobs with one conditional UPDATE each, so two workers never own one
job, renew a lease while they run, and a job whose worker died is claimed again. The database
(SQLite in WAL mode by default, PostgreSQL in production) is the only shared state. See
docs/SERVICE.md.
"""
