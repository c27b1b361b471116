"""Projects and API keys. A key is ``rlrun_<prefix>_<secret>`` (256 random bits); the server stores only
its sha256 (a fast hash is enough for a high-entropy secret) and finds it by its prefix."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.models import ApiKey, Project, utcnow


class Unauthorized(ApiError):
    status = 401
    code = "unauthorized"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_project(*, session: Session, name: str) -> Project:
    project = session.scalars(select(Project).where(Project.name == name)).one_or_none()
    if project is None:
        project = Project(id=uuid.uuid4(), name=name, created_at=utcnow())
        session.add(project)
        session.flush()
    return project


def create_api_key(*, session: Session, project_name: str) -> tuple[str, ApiKey]:
    """A new key for the project (created if needed). The plain key is returned once, never stored."""
    project = get_or_create_project(session=session, name=project_name)
    prefix = secrets.token_hex(4)
    key = f"rlrun_{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiKey(
        id=uuid.uuid4(), project_id=project.id, prefix=prefix, key_hash=_hash(key), created_at=utcnow()
    )
    session.add(row)
    session.flush()
    return key, row


def revoke_api_key(*, session: Session, prefix: str) -> bool:
    row = session.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).one_or_none()
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    session.flush()
    return True


def project_of_key(*, session: Session, authorization: str | None) -> uuid.UUID:
    """The project of a valid ``Authorization: Bearer <key>``, or Unauthorized (same answer for every
    kind of bad key, compared in constant time)."""
    scheme, _, key = (authorization or "").partition(" ")
    parts = key.strip().split("_", 2)
    if scheme.lower() != "bearer" or len(parts) != 3 or parts[0] != "rlrun":
        raise Unauthorized("send `Authorization: Bearer <API key>` (create one with `rlrun keys create`)")
    row = session.scalars(select(ApiKey).where(ApiKey.prefix == parts[1])).one_or_none()
    if row is None or row.revoked_at is not None or not hmac.compare_digest(row.key_hash, _hash(key.strip())):
        raise Unauthorized("invalid or revoked API key")
    return row.project_id
