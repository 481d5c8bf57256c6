"""Alembic's entry point: run the migrations on the connection `service.db.migrate` passes in.

Run from the `alembic` command line instead (a new revision, `--autogenerate`), it connects to
`TAGPLAN_DATABASE_URL` and compares against the service's tables.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, MetaData, create_engine


def _run(connection: Connection, target_metadata: MetaData | None) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    """Online migrations only: on the handed-over connection, else on `TAGPLAN_DATABASE_URL`."""
    connection = context.config.attributes.get("connection")
    metadata = context.config.attributes.get("target_metadata")
    if connection is not None:
        _run(connection, metadata)
        return
    from tagplan.service import db  # the command line only: `migrate` passes the metadata itself

    engine = create_engine(os.environ["TAGPLAN_DATABASE_URL"])
    with engine.begin() as conn:
        _run(conn, db.Base.metadata)


main()
