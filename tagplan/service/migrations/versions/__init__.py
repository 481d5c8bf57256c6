"""One Alembic revision per module, applied in `down_revision` order (see the package's docstring)."""
