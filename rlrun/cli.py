"""``rlrun``: serve (API + one worker), worker, migrate, keys, demo; and, against a running server,
datasets (upload, list), environments (create, list, delete), runs (create, list, get, watch, cancel,
download) and models (list, import)."""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from rlrun.commands import add_client_commands
from rlrun.server_commands import add_server_commands

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def build_parser() -> argparse.ArgumentParser:
    """Every ``rlrun`` command: the server's (serve, worker, migrate, keys, demo) and the client's."""
    parser = argparse.ArgumentParser(prog="rlrun", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_commands(sub)
    add_client_commands(sub)  # datasets ..., runs ...: the REST API's client commands
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except ValidationError as exc:
        if exc.title != "Settings":  # not the environment's fault: a bug, with its traceback
            raise
        for error in exc.errors():  # an RLRUN_* variable the server cannot use: named, no traceback
            field = ".".join(str(p) for p in error["loc"])
            head, _, rest = field.partition(".")
            print(f"error: RLRUN_{head.upper()}{'.' + rest if rest else ''}: {error['msg']}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
