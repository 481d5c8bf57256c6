"""The service's schema as Alembic migrations, applied by `service.db.make_engine` (`migrate`).

`env.py` runs them on the connection `migrate` hands over (config attribute `connection`), so
they never open a database of their own; `versions/` holds one revision per schema change:

    r0001  the tables as they were before migrations (tenants, api_keys, jobs, traces)
    r0002  idempotency_keys (a tenant's Idempotency-Key and the job or trace it made)

A new revision: `alembic -c tagplan/service/migrations/alembic.ini revision -m "what"` (with
`TAGPLAN_DATABASE_URL` set, `--autogenerate` compares against `service.db.Base`), then edit it.
"""
