"""API keys: created once (the plaintext is shown to the operator and never stored), kept as sha256.

A key is `tp_` and 32 URL-safe characters (192 random bits), so a fast unsalted hash is enough: a
leaked table cannot be brute-forced back into keys. The first 8 characters are kept as `prefix`
so an operator can tell keys apart in listings.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tagplan.errors import SpecError
from tagplan.service.db import ApiKey, Tenant, utcnow

KEY_PREFIX = "tp_"
KEY_RANDOM_BYTES = 24  # -> 32 URL-safe characters
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class Principal:
    """Who a valid key belongs to."""

    tenant_id: int
    tenant: str
    admin: bool


def hash_key(key: str) -> str:
    """The sha256 hex digest stored for `key`."""
    return hashlib.sha256(key.encode()).hexdigest()


def ensure_tenant(engine: Engine, name: str) -> int:
    """The id of tenant `name`, created if new; SpecError for a name that is not accepted."""
    if not _TENANT_NAME.fullmatch(name):
        raise SpecError(f"tenant {name!r}: expected 1-100 characters of letters, digits, '_', '.', '-' "
                        "starting with a letter or digit")
    for _ in range(3):  # two processes creating one tenant: the loser reads the winner's row
        with Session(engine) as session:
            found = session.scalar(select(Tenant.id).where(Tenant.name == name))
            if found is not None:
                return found
            tenant = Tenant(name=name)
            session.add(tenant)
            try:
                session.commit()
            except IntegrityError:
                session.rollback()
                continue
            return tenant.id
    raise RuntimeError(f"could not create or find tenant {name!r}")


def create_key(engine: Engine, tenant: str, *, admin: bool = False) -> str:
    """A new API key for `tenant` (created if new); the plaintext is returned once and not stored."""
    tenant_id = ensure_tenant(engine, tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)
    with Session(engine) as session:
        session.add(ApiKey(tenant_id=tenant_id, prefix=key[:8], key_hash=hash_key(key), admin=admin))
        session.commit()
    return key


def authenticate(engine: Engine, key: str) -> Principal | None:
    """The principal of a valid, unrevoked `key`; None otherwise."""
    if not key.startswith(KEY_PREFIX):
        return None
    query = (select(ApiKey.tenant_id, Tenant.name, ApiKey.admin)
             .join(Tenant, Tenant.id == ApiKey.tenant_id)
             .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))
    with engine.connect() as conn:
        row = conn.execute(query).first()
    return None if row is None else Principal(tenant_id=row[0], tenant=row[1], admin=bool(row[2]))


def revoke_key(engine: Engine, key: str) -> bool:
    """Revoke `key` (the whole key, or its 8-character prefix as listed when that names exactly one
    valid key); True if it was valid until now. A revoked key answers 401 at once."""
    if len(key) == len(KEY_PREFIX) + 5:
        with engine.connect() as conn:
            hashes = conn.execute(select(ApiKey.key_hash).where(ApiKey.prefix == key,
                                                                ApiKey.revoked_at.is_(None))).scalars().all()
        if len(hashes) != 1:
            return False
        where = ApiKey.key_hash == hashes[0]
    else:
        where = ApiKey.key_hash == hash_key(key)
    with engine.begin() as conn:
        done = conn.execute(update(ApiKey).where(where, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow()))
    return bool(done.rowcount)
