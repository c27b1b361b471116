"""How far a reader travels following a DPO spec from ``run_dpo`` into its loss: files entered, and how often
the path comes back to a file it had left.

What is measured, exactly:

- One tiny DPO run (``tiny:llama-0.4m``, 12 arithmetic pairs, ``max_steps=1``, ``batch_size=4``, default
  hyperparameters otherwise) is driven as the loop tests drive it: ``run_dpo(spec, RunData, MemoryReporter(),
  LoopContext)``. The tiny preset is built before measuring, so building it is not part of the path.
- From the call of ``run_dpo`` until the first call of a function defined in
  ``trainer/algorithms/preference_losses.py`` (the first loss computation, inside the first step), every
  Python function call (``sys.setprofile`` "call" events: functions, methods, lambdas, comprehensions,
  generator resumptions; C functions are not counted) whose code lives in a project file under ``trainer/``
  or ``api/`` is recorded with that file, whoever the caller (a ``@contextmanager`` body entered through
  contextlib counts); calls into library code (torch, transformers, contextlib) are not recorded.
- Consecutive calls in the same file collapse into one *stay*. A *return* is a stay in a file that already
  had an earlier stay, not the one just before it (A B A: one return, to A).

With ``--first-calls`` only each function's first call is recorded (a reader reads a function once; the
later steps' and passes' repeats are dropped). Printed: the number of stays, of distinct files and of
returns, then the stays in order (``--quiet``: the three numbers only). Run from the repository root, or
with ``PYTHONPATH`` pointing at another checkout to measure that one (files are counted under the folder
that holds the imported ``trainer`` package)::

    .venv/bin/python scripts/call_path.py
    PYTHONPATH=/tmp/head .venv/bin/python scripts/call_path.py   # a worktree of an older commit
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path
from types import CodeType, FrameType
from typing import Any


def walk(first_calls: bool = False) -> list[str]:
    """The project files of the calls from ``run_dpo`` to the first loss, in call order (one per call;
    ``first_calls``: only each function's first call)."""
    import trainer
    from trainer.loops.dpo import run_dpo
    from trainer.models import resolve_model
    from trainer.reporting import LoopContext, MemoryReporter, RunData
    from trainer.specs import parse_spec

    root = Path(trainer.__file__).parent.parent
    project = (f"{root / 'trainer'}/", f"{root / 'api'}/")
    loss_file = str(root / "trainer" / "algorithms" / "preference_losses.py")
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(4)
        for b in range(3)
    ]
    spec = parse_spec(
        {
            "algorithm": "dpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "hyperparameters": {"max_steps": 1, "batch_size": 4, "learning_rate": 1e-2},
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"

        def no_runs(ref: str) -> Path:
            raise AssertionError(f"unexpected run reference {ref}")

        resolve_model("tiny:llama-0.4m", cache_dir=cache, run_output=no_runs)  # built before measuring
        ctx = LoopContext(
            cache_dir=cache,
            checkpoint_dir=Path(tmp) / "out",
            resume_from=None,
            resolve_model=lambda ref: resolve_model(ref, cache_dir=cache, run_output=no_runs),
        )
        calls: list[tuple[CodeType, str]] = []
        done = [False]

        def profile(frame: FrameType, event: str, _arg: Any) -> None:
            filename = frame.f_code.co_filename
            if done[0] or event != "call" or not filename.startswith(project):
                return
            calls.append((frame.f_code, str(Path(filename).relative_to(root))))
            if filename == loss_file:
                done[0] = True

        sys.setprofile(profile)
        try:
            run_dpo(spec, RunData(train=rows), MemoryReporter(), ctx)  # type: ignore[arg-type]
        finally:
            sys.setprofile(None)
        if not done[0]:
            raise SystemExit("the run ended without calling a preference loss")
    if first_calls:
        seen: set[CodeType] = set()
        calls = [c for c in calls if not (c[0] in seen or seen.add(c[0]))]  # type: ignore[func-returns-value]
    return [f for _, f in calls]


def stays_of(files: list[str]) -> list[str]:
    """``files`` with consecutive repeats collapsed: one entry per stay."""
    return [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]


def returns_of(stays: list[str]) -> int:
    """Stays in a file that had an earlier stay (never the one just before: stays alternate files)."""
    seen: set[str] = set()
    count = 0
    for f in stays:
        count += f in seen
        seen.add(f)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="print the three numbers only")
    parser.add_argument(
        "--first-calls", action="store_true", help="count each function at its first call only (read once)"
    )
    args = parser.parse_args()
    stays = stays_of(walk(args.first_calls))
    out = [f"stays: {len(stays)}  files: {len(set(stays))}  returns: {returns_of(stays)}"]
    if not args.quiet:
        seen: set[str] = set()
        for i, f in enumerate(stays, 1):
            out.append(f"{i:3d} {'(return) ' if f in seen else '         '}{f}")
            seen.add(f)
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
