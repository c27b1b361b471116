"""Apply Alembic migrations from code (``rlrun serve``, ``rlrun migrate`` and the tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

ROOT = Path(__file__).resolve().parent.parent


def alembic_config(url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_head(url: str) -> None:
    """Bring the database at ``url`` to the newest revision (idempotent)."""
    command.upgrade(alembic_config(url), "head")
