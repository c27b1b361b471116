"""What the bench scripts share besides the clock (bench/clock.py), torch-free: ``quiet`` (the
datasets/transformers/accelerate chatter off before TRL runs) and ``throwaway_postgres`` (a new, empty
database dropped afterwards). A sibling module (``python bench/x.py`` puts bench/ first on sys.path);
running it does nothing (``make bench`` runs every file in bench/)."""

from __future__ import annotations

import logging
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text


def quiet() -> None:
    """datasets, transformers and accelerate logging and progress bars off; warnings ignored."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


@contextmanager
def throwaway_postgres(server_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``server_url``; dropped afterwards (the tests' pattern)."""
    name = f"rlrun_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield server_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
