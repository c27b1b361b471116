"""Pure text rendering for the CLI: sparklines, progress bars, a run's long phase and health warnings, and
the ``runs watch`` frame.

Plain values in, strings out: nothing here reads the clock, the terminal or the network, so every
function is tested against hand-derived strings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

BLOCKS = "▁▂▃▄▅▆▇█"
FLAT = BLOCKS[3]  # a constant series: a level line, not mistaken for "at its minimum"
FULL, EMPTY = "█", "░"

# Shown first by `runs watch`, when the run has them: rewards, then losses, then KL and the rest.
PREFERRED_KEYS = (
    "reward/mean",
    "rewards/accuracy",
    "rewards/margin",
    "accuracy",
    "eval/accuracy",
    "loss",
    "loss/policy",
    "loss/value",
    "token_accuracy",
    "margin",
    "kl/ref",
    "kl/seq",
    "policy/approx_kl",
    "policy/entropy",
    "policy/clipfrac",
    "scores/mean",
    "response/length_mean",
)
# Then any other key, by the first of these words it contains (none: after all of them, by name).
KEY_WORDS = ("reward", "loss", "kl", "accuracy", "margin", "entropy")
# One value at the end (final/*) or bookkeeping: never drawn as a sparkline.
SKIPPED_PREFIXES = ("final/", "perf/")
SKIPPED_KEYS = ("lr",)
# The long phases a run goes through besides its steps (rlrun.schemas.PHASES; a test keeps them equal), as
# the CLI and the dashboard (api/static/app.js: PHASE_LABELS) name them.
PHASE_LABELS: Mapping[str, str] = MappingProxyType(
    {
        "model_load": "loading model",
        "tokenize": "tokenising",
        "reference": "reference log-probs",
        "rollouts": "rollouts",
        "eval": "evaluating",
        "final_metrics": "final metrics",
        "checkpoint": "writing checkpoint",
    }
)


def resample(values: Sequence[float], width: int) -> list[float]:
    """At most ``width`` points. A longer series is averaged over ``width`` consecutive buckets
    (bucket ``i`` holds indices ``[i*n//width, (i+1)*n//width)``); a shorter one is kept as is."""
    n = len(values)
    if n <= width:
        return list(values)
    buckets = [values[i * n // width : (i + 1) * n // width] for i in range(width)]
    return [sum(b) / len(b) for b in buckets]


def sparkline(values: Sequence[float], width: int) -> str:
    """The series as block characters ``▁▂▃▄▅▆▇█``, min-max scaled, at most ``width`` characters.

    Non-finite values are left out; a constant series is a row of ``▄``; no values (or no width) is
    ``""``. Level ``i`` is ``(v - min) / (max - min) * 7`` rounded half up."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or width <= 0:
        return ""
    points = resample(finite, width)
    lo, hi = min(points), max(points)
    if hi == lo:
        return FLAT * len(points)
    top = len(BLOCKS) - 1
    return "".join(BLOCKS[min(top, int((v - lo) / (hi - lo) * top + 0.5))] for v in points)


def bar(done: float, total: float, width: int) -> str:
    """``width`` cells, ``floor(done / total * width)`` of them full (so full only when done)."""
    fraction = 1.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = int(fraction * width)
    return FULL * filled + EMPTY * (width - filled)


def percent(done: float, total: float) -> int:
    """Whole percent, rounded down (100 only when done); an empty total counts as done."""
    return 100 if total <= 0 else int(min(1.0, max(0.0, done / total)) * 100)


def human_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``2.0 MiB`` ... (binary units, one decimal)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def progress_line(label: str, sent: int, total: int, width: int = 24) -> str:
    """One upload progress line: ``label  ████░░░░  50%  1.0 KiB / 2.0 KiB``."""
    return (
        f"{label}  {bar(sent, total, width)}  {percent(sent, total):3d}%  "
        f"{human_bytes(sent)} / {human_bytes(total)}"
    )


def format_value(value: float) -> str:
    """Four significant digits: ``0.3444``, ``1``, ``-12.5``, ``1.235e+04``, ``nan``."""
    return f"{value:.4g}"


def key_metrics(keys: Sequence[str], limit: int = 6) -> list[str]:
    """The metrics worth watching among ``keys``: :data:`PREFERRED_KEYS` in that order, then the
    others ranked by :data:`KEY_WORDS` and name; ``final/*``, ``perf/*`` and ``lr`` are left out."""
    shown = [k for k in keys if not k.startswith(SKIPPED_PREFIXES) and k not in SKIPPED_KEYS]
    preferred = [k for k in PREFERRED_KEYS if k in shown]

    def rank(key: str) -> tuple[int, str]:
        words = [i for i, word in enumerate(KEY_WORDS) if word in key.lower()]
        return (words[0] if words else len(KEY_WORDS), key)

    rest = sorted((k for k in shown if k not in preferred), key=rank)
    return (preferred + rest)[:limit]


def phase_label(phase: str) -> str:
    """The phase's name for people (:data:`PHASE_LABELS`); an unknown one with its underscores as spaces."""
    return PHASE_LABELS.get(phase, phase.replace("_", " "))


def phase_text(phase: str, done: int | None, total: int | None) -> str:
    """``reference log-probs 120/1300``; with no known total ``loading model…``, or ``tokenising… 1200
    done`` once items are counted."""
    label = phase_label(phase)
    if total is None:
        return f"{label}…" + (f" {done} done" if done else "")
    return f"{label} {done or 0}/{total}"


def progress_cell(
    step: int,
    total_steps: int | None,
    phase: str | None = None,
    done: int | None = None,
    total: int | None = None,
) -> str:
    """A run's progress in one short cell (``runs list``): ``5/10``; inside a long phase its code and
    percent, ``reference 9%``, or ``model_load…`` with no known total."""
    if phase is None:
        return f"{step}/{total_steps}" if total_steps else str(step)
    return f"{phase} {percent(done or 0, total)}%" if total is not None else f"{phase}…"


class HealthWarning(NamedTuple):
    """One of a run's warnings (``RunRead.warnings``): the rule's code, the step it fired at, its message."""

    code: str
    step: int
    message: str


def warning_text(warning: HealthWarning) -> str:
    """``zero_advantage at step 3: <message>``."""
    return f"{warning.code} at step {warning.step}: {warning.message}"


@dataclass(frozen=True)
class WatchState:
    """What one ``runs watch`` frame shows: the run, its long phase while one is under way (``phase`` with
    ``phase_done`` of ``phase_total`` items, the total None when unknown), its warnings and its key series
    (values in step order)."""

    run_id: str
    status: str
    step: int
    total_steps: int | None
    algorithm: str = ""
    model: str = ""
    name: str | None = None
    error: str | None = None
    series: Mapping[str, Sequence[float]] = field(default_factory=dict)
    phase: str | None = None
    phase_done: int | None = None
    phase_total: int | None = None
    warnings: Sequence[HealthWarning] = ()


def _step_text(state: WatchState) -> str:
    return f"{state.step}/{state.total_steps}" if state.total_steps else str(state.step)


def progress_lines(state: WatchState, bar_width: int = 24) -> list[str]:
    """The frame's ``step`` line and, inside a long phase, its ``phase`` line (the phase alone while no
    step has been taken: ``step 0/N`` says nothing then)::

        phase   reference log-probs 120/1300  ██░░░░░░░░░░░░░░░░░░░░░░    9%
    """
    lines = []
    if state.phase is None or state.step > 0:
        if state.total_steps:
            done = bar(state.step, state.total_steps, bar_width)
            pct = percent(state.step, state.total_steps)
            lines.append(f"step    {_step_text(state)}  {done}  {pct:3d}%")
        else:
            lines.append(f"step    {state.step}")
    if state.phase is not None:
        line = f"phase   {phase_text(state.phase, state.phase_done, state.phase_total)}"
        if state.phase_total is not None:
            done_items = state.phase_done or 0
            pct = percent(done_items, state.phase_total)
            line += f"  {bar(done_items, state.phase_total, bar_width)}  {pct:3d}%"
        lines.append(line)
    return lines


def watch_frame(state: WatchState, *, width: int = 100, bar_width: int = 24, spark_width: int = 32) -> str:
    """The live view, one line per item, each cut to ``width`` characters::

    run <id>  dpo  tiny:llama-0.4m
    status  running
    step    5/10  ████████████░░░░░░░░░░░░   50%
    loss      0.6931  ▁▃▅█
    warning zero_advantage at step 3: <message>

    (the step line as :func:`progress_lines` has it; one ``warning`` line per warning)
    """
    title = "  ".join(p for p in (f"run {state.run_id}", state.algorithm, state.model) if p)
    lines = [title + (f"  ({state.name})" if state.name else ""), f"status  {state.status}"]
    lines += progress_lines(state, bar_width)
    if state.series:
        name_width = max(len(k) for k in state.series)
        for key, values in state.series.items():
            last = format_value(values[-1]) if values else "-"
            lines.append(f"{key:<{name_width}}  {last:>10}  {sparkline(values, spark_width)}".rstrip())
    else:
        lines.append("(no metrics yet)")
    lines += [f"warning {warning_text(w)}" for w in state.warnings]
    if state.error:
        lines.append(f"error   {state.error}")
    return "\n".join(line[:width] for line in lines)


def status_line(state: WatchState) -> str:
    """One plain line per change when the output is not a terminal: ``running  step 5/10  loss=0.6931``;
    inside a long phase its text instead of ``step 0`` (after the step once there is one); the warnings'
    codes last (``warnings=zero_advantage,kl_diverging``)."""
    step = f"step {_step_text(state)}" if state.phase is None or state.step > 0 else ""
    phase = phase_text(state.phase, state.phase_done, state.phase_total) if state.phase is not None else ""
    values = "  ".join(f"{k}={format_value(v[-1])}" for k, v in state.series.items() if v)
    flagged = "warnings=" + ",".join(w.code for w in state.warnings) if state.warnings else ""
    return "  ".join(p for p in (state.status, step, phase, values, flagged) if p)


def redraw(frame: str, previous_lines: int) -> str:
    """Terminal bytes that replace the previous frame (``previous_lines`` lines, cursor below it) with
    ``frame``: cursor up, clear to the end of the screen, the frame and a newline."""
    up = f"\x1b[{previous_lines}A" if previous_lines else ""
    return f"\r{up}\x1b[J{frame}\n"
