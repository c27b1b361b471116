"""The image and the compose file run what they name: the Dockerfile copies every package the `rlrun`
command imports, and every compose service command parses as an `rlrun` command."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def dockerfile_copies() -> list[str]:
    """The sources of the Dockerfile's COPY instructions (files and folders of the repository)."""
    sources: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = shlex.split(line)
        if words and words[0].upper() == "COPY":
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


@pytest.mark.slow
def test_the_files_the_dockerfile_copies_install_a_working_rlrun(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for source in dockerfile_copies():
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, context / source)
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(context),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # Only what the image has: the installed copy first, not this checkout (the dependencies come from
    # this environment, as pip installs them in the image).
    env = {**os.environ, "PYTHONPATH": str(target)}
    for argv in (["--help"], ["datasets", "upload", "--help"], ["serve", "--help"]):
        out = subprocess.run(
            [sys.executable, "-c", "import sys; from rlrun.cli import main; sys.exit(main())", *argv],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, (argv, out.stderr[-2000:])
    where = subprocess.run(
        [sys.executable, "-c", "import rlrun, api; print(rlrun.__file__, api.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.count(str(target)) == 2, where  # the installed packages, not the checkout's


def test_every_compose_command_is_an_rlrun_command() -> None:
    from rlrun.cli import build_parser

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    checked = 0
    for name, service in compose["services"].items():
        command = service.get("command")
        if "build" not in service or not command:
            continue
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        assert argv[0] == "rlrun", (name, argv)
        args = build_parser().parse_args(argv[1:])  # argparse exits on an unknown command or option
        assert callable(args.func), name
        checked += 1
    assert checked >= 2  # the api and the worker
