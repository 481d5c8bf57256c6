"""The planning service: an HTTP API over a durable job queue, worked by separate processes.

A request never plans: it validates (`requests.PlanRequest`: parsed SPECs, limits read off the
parse, nothing built), stores a job (`store.JobStore`) and answers. Worker processes
(`worker.run_worker`) claim jobs with one conditional UPDATE each, so two workers never own one
job, renew a lease while they run, and a job whose worker died is claimed again; `jobs.run_job`
reads the stored request back with the same model and does the work. The database (SQLite in WAL
mode by default, PostgreSQL in production) is the only shared state. See docs/SERVICE.md.
"""
