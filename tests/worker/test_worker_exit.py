"""`rlrun worker` exits non-zero when Celery stops it on an error it cannot recover from, so whatever
keeps it (`rlrun serve`, systemd, Docker) sees a failure and starts another (Celery's `worker_main`
returned nothing and the command exited 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The queue's declaration fails with an error kombu does not count as a connection error, as the
# queue-row race did (tests/worker/test_sql_broker.py).
FAILING_WORKER = """
import sys
from api import sql_broker
def refuse(self, queue):
    raise RuntimeError("no queue for you")
sql_broker.Channel._get_or_create = refuse
from rlrun.cli import main
sys.exit(main(["worker"]))
"""


def test_a_worker_celery_cannot_recover_exits_1(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLRUN_")} | {"RLRUN_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", FAILING_WORKER], env=env, capture_output=True, text=True, timeout=120
    )
    assert "Unrecoverable error" in done.stderr and "no queue for you" in done.stderr, done.stderr[-2000:]
    assert done.returncode == 1
