"""Run health: watch a run's logged metrics step by step and say when the run cannot learn.

Pure and stdlib-only (no torch, no DB), so the worker, the API and tests can all use it. The loop logs one
dict of floats per step; ``RunHealth.observe`` turns it into at most one warning per code per run.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

WARNING_CODES = (
    "zero_advantage",
    "loss_diverging",
    "kl_diverging",
    "reward_collapse",
    "chosen_falling",
    "nonfinite_skipped",
)
WINDOW = 3  # consecutive counted steps a rule needs
KL_LIMIT = 1.0  # nats per token
FLAT = 1e-6  # a std at or below this is "one value"


@dataclass(frozen=True)
class RunWarning:
    """A fired rule: ``code`` is in WARNING_CODES; ``message`` is one sentence naming the values and rule."""

    code: str
    step: int
    message: str


def _num(x: float) -> str:
    return f"{x:.4g}"


class _Streak:
    """The last ``window`` counted steps that met a rule's condition, as ``(step, description)``."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.hits: deque[tuple[int, str]] = deque(maxlen=window)

    def push(self, step: int, seen: str) -> bool:
        """Record a step that meets the condition; True when the streak has reached ``window``."""
        self.hits.append((step, seen))
        return len(self.hits) == self.window

    def reset(self) -> None:
        self.hits.clear()

    def describe(self) -> str:
        return ", ".join(f"{seen} at step {step}" for step, seen in self.hits)


class RunHealth:
    """Watches one run's per-step metrics and warns, once per code, when a rule says it cannot learn.

    Counting: a rule *counts* a step only when the step's dict has that rule's metric(s) with a finite
    value. A step that is not counted neither advances nor resets the rule's streak; a counted step that
    does not meet the condition resets the streak to 0. A streak rule fires at the ``window``-th
    consecutive counted step that meets its condition. Each code fires at most once per RunHealth.

    Rules (FLAT = 1e-6; defaults window = 3, kl_limit = 1.0 nats per token):

    - ``zero_advantage``: counts steps with a finite ``groups/zero_variance_frac`` or ``adv/std``. The
      step is zero when ``groups/zero_variance_frac >= 1.0`` (every sampled group had equal rewards) or
      ``abs(adv/std) <= FLAT`` (either one suffices when both are logged). Fires at the ``window``-th
      consecutive zero step: the policy gradient is zero, so the weights do not move.
    - ``reward_collapse``: counts steps with a finite ``reward/std``. Fires when ``reward/std <= FLAT`` at
      ``window`` consecutive counted steps and some earlier counted step had ``reward/std > FLAT``
      (rewards varied, then collapsed to one value). Rewards flat from the first step do not fire it.
    - ``kl_diverging``: counts steps with a finite ``kl/ref``. Fires when ``kl/ref > kl_limit`` at
      ``window`` consecutive counted steps.
    - ``loss_diverging``: counts steps with a finite ``loss``. ``lowest`` is the lowest finite ``loss``
      seen so far, including the current step; the step is diverging when
      ``loss - lowest > max(1.0, abs(lowest))``. Fires at the ``window``-th consecutive diverging step.
    - ``chosen_falling`` (preference runs): counts steps with a finite ``logps/chosen`` (the chosen
      answers' summed log-probability); ``first`` is the first counted value. The step is falling when
      ``first - logps/chosen > 3 * max(1.0, abs(first))``: the chosen answers' negative log-likelihood has
      more than quadrupled (and grown by at least 3 nats). Fires at the ``window``-th consecutive falling
      step. DPO can widen its margin by lowering both answers until the policy produces neither
      (bench/dpo_generation.py: plain DPO at lr 1e-3 fires at step 5 and ends at 0% held-out exact match;
      a batch's value is noisy, and DPO with rpo_alpha at the same lr dips to 3x then recovers, so the
      factor is 3, not 1).
    - ``nonfinite_skipped``: fires at once, on the first step where any value in the dict is NaN or
      +-inf, or ``skipped_updates > 0``. Non-finite values are not counted by the other rules.

    When several rules fire at the same step, ``observe`` returns them in WARNING_CODES order.
    """

    def __init__(self, *, window: int = WINDOW, kl_limit: float = KL_LIMIT) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not math.isfinite(kl_limit):
            raise ValueError(f"kl_limit must be finite, got {kl_limit}")
        self.window = window
        self.kl_limit = kl_limit
        self._fired: set[str] = set()
        self._streaks = {code: _Streak(window) for code in WARNING_CODES}
        self._lowest_loss = math.inf
        self._reward_varied = False
        self._first_chosen: float | None = None

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[RunWarning]:
        """Feed one step's logged metrics; returns the warnings whose rule fires now.

        Each code fires at most once per RunHealth.
        """
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
        found = {
            "zero_advantage": self._zero_advantage(step, finite),
            "loss_diverging": self._loss_diverging(step, finite),
            "kl_diverging": self._kl_diverging(step, finite),
            "reward_collapse": self._reward_collapse(step, finite),
            "chosen_falling": self._chosen_falling(step, finite),
            "nonfinite_skipped": self._nonfinite_skipped(metrics),
        }
        warnings = []
        for code in WARNING_CODES:
            message = found[code]
            if message is not None and code not in self._fired:
                self._fired.add(code)
                warnings.append(RunWarning(code=code, step=step, message=message))
        return warnings

    def _track(self, code: str, step: int, hit: bool, seen: str) -> bool:
        """Advance or reset ``code``'s streak for a counted step; True when it reaches the window."""
        streak = self._streaks[code]
        if not hit:
            streak.reset()
            return False
        return streak.push(step, seen)

    def _zero_advantage(self, step: int, m: dict[str, float]) -> str | None:
        frac, adv_std = m.get("groups/zero_variance_frac"), m.get("adv/std")
        if frac is None and adv_std is None:
            return None
        seen = " ".join(
            f"{key}={_num(v)}"
            for key, v in (("groups/zero_variance_frac", frac), ("adv/std", adv_std))
            if v is not None
        )
        zero = (frac is not None and frac >= 1.0) or (adv_std is not None and abs(adv_std) <= FLAT)
        if not self._track("zero_advantage", step, zero, seen):
            return None
        seen = self._streaks["zero_advantage"].describe()
        return (
            f"Advantages were zero for {self.window} consecutive steps ({seen}): "
            f"the rule is groups/zero_variance_frac >= 1 or |adv/std| <= {_num(FLAT)}, meaning every group's "
            "rewards were equal, so the policy gets no learning signal."
        )

    def _loss_diverging(self, step: int, m: dict[str, float]) -> str | None:
        loss = m.get("loss")
        if loss is None:
            return None
        self._lowest_loss = min(self._lowest_loss, loss)
        lowest = self._lowest_loss
        margin = max(1.0, abs(lowest))
        if not self._track("loss_diverging", step, loss - lowest > margin, f"loss={_num(loss)}"):
            return None
        seen = self._streaks["loss_diverging"].describe()
        return (
            f"The loss diverged for {self.window} consecutive steps ({seen}): each exceeded the lowest "
            f"loss so far, {_num(lowest)}, by more than max(1, |lowest|) = {_num(margin)}."
        )

    def _kl_diverging(self, step: int, m: dict[str, float]) -> str | None:
        kl = m.get("kl/ref")
        if kl is None:
            return None
        if not self._track("kl_diverging", step, kl > self.kl_limit, f"kl/ref={_num(kl)}"):
            return None
        seen = self._streaks["kl_diverging"].describe()
        return (
            f"The KL to the reference model stayed above {_num(self.kl_limit)} nats per token for "
            f"{self.window} consecutive steps ({seen}): the policy is drifting away from it."
        )

    def _reward_collapse(self, step: int, m: dict[str, float]) -> str | None:
        std = m.get("reward/std")
        if std is None:
            return None
        flat = std <= FLAT
        # A streak only fires after rewards varied; a varied step resets the streak, so it precedes it.
        fires = self._track("reward_collapse", step, flat, f"reward/std={_num(std)}") and self._reward_varied
        self._reward_varied = self._reward_varied or not flat
        if not fires:
            return None
        mean = m.get("reward/mean")
        value = f" (reward/mean={_num(mean)})" if mean is not None else ""
        seen = self._streaks["reward_collapse"].describe()
        return (
            f"Rewards collapsed to one value{value}: reward/std <= {_num(FLAT)} for {self.window} "
            f"consecutive steps ({seen}) after earlier steps had varied rewards."
        )

    def _chosen_falling(self, step: int, m: dict[str, float]) -> str | None:
        chosen = m.get("logps/chosen")
        if chosen is None:
            return None
        if self._first_chosen is None:
            self._first_chosen = chosen
        first = self._first_chosen
        margin = 3 * max(1.0, abs(first))
        if not self._track("chosen_falling", step, first - chosen > margin, f"logps/chosen={_num(chosen)}"):
            return None
        seen = self._streaks["chosen_falling"].describe()
        return (
            f"The chosen answers' log-probability fell from {_num(first)} for {self.window} consecutive "
            f"steps ({seen}), each more than 3 max(1, |first|) = {_num(margin)} below it: the preference "
            "margin can grow while both answers become unlikely, and the policy's own answers get worse. "
            "A lower learning rate or rpo_alpha > 0 (an NLL term on the chosen answer) holds them up."
        )

    def _nonfinite_skipped(self, metrics: Mapping[str, float]) -> str | None:
        bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        skipped = metrics.get("skipped_updates", 0.0)
        parts = []
        if bad:
            parts.append("non-finite values in " + ", ".join(f"{k}={metrics[k]}" for k in bad))
        if math.isfinite(skipped) and skipped > 0:
            parts.append(f"skipped_updates={_num(skipped)}")
        if not parts:
            return None
        found = " and ".join(parts)
        return f"The step logged {found}: NaN/inf values or skipped updates mean this step did not train."
