"""Judge models for ``score_model`` graders, loaded by the worker on first use and kept for the run.

A judge's score for a sample (trainer/specs/graders.py, ``ScoreModelGrader``), with ``[low, high]`` its
``range``:

* a **reward model** (a folder or run whose model is a score head): its score ``s`` of the rendered
  ``input`` conversation (the prompt) with the sample's text as the answer, standardised with the run's
  stored statistics where they exist (as the ``reward_model`` reward), then ``low + (high - low) *
  sigmoid(s)``;
* a **generative model**: it answers the rendered ``input`` messages (chat template), greedily unless
  ``sampling_params.temperature`` > 0, in at most ``max_completions_tokens`` tokens; the first number in its
  answer, clamped to ``[low, high]``, is the score. An answer without a number fails that sample (reward 0,
  counted in ``reward/failures``).

Torch lives here; trainer/graders/grade.py (which the API imports) only calls a ``JudgeScorer``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.specs.graders import ScoreModelGrader

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def first_number(text: str) -> float | None:
    """The first number written in ``text`` (``7``, ``-0.5``, ``.25``, ``1e-3``), or None."""
    found = _NUMBER.search(text)
    if found is None:
        return None
    value = float(found.group())
    return value if math.isfinite(value) else None


def squash(score: float, low: float, high: float) -> float:
    """A reward model's unbounded score into ``[low, high]``: ``low + (high - low) * sigmoid(score)``."""
    return low + (high - low) / (1.0 + math.exp(-score)) if score > -700 else low


class Judges:
    """Judge models by reference, loaded when first asked for (``resolve_model`` gives the folder)."""

    def __init__(self, resolve_model: Callable[[str], Any], device: torch.device) -> None:
        self.resolve_model, self.device = resolve_model, device
        self.loaded: dict[str, Any] = {}

    def _judge(self, ref: str) -> Any:
        if ref not in self.loaded:
            from trainer.inference.loaded import is_scorer

            folder = str(self.resolve_model(ref))
            if is_scorer(folder):
                from trainer.rewards.reward_model_scorer import RewardModelScorer

                self.loaded[ref] = RewardModelScorer(folder, normalize=True, device=self.device)
            else:
                from trainer.models import load_causal_lm

                model, tokenizer = load_causal_lm(folder)
                self.loaded[ref] = (model.to(self.device).eval().requires_grad_(False), tokenizer)
        return self.loaded[ref]

    def __call__(
        self, grader: ScoreModelGrader, conversations: Sequence[list[dict[str, str]]], texts: Sequence[str]
    ) -> list[tuple[float | None, str | None]]:
        """(score, None) or (None, why) per sample."""
        from trainer.data.prompts import render_prompt

        low, high = grader.range
        judge = self._judge(grader.model)
        if not isinstance(judge, tuple):  # a reward model
            prompts = [render_prompt(c, judge.tokenizer) for c in conversations]
            return [(squash(s, low, high), None) for s in judge.score(prompts, list(texts))]
        model, tokenizer = judge
        return [
            (None, f"the judge wrote no number: {answer[:80]!r}")
            if (value := first_number(answer)) is None
            else (min(high, max(low, value)), None)
            for answer in self._answers(model, tokenizer, grader, conversations)
        ]

    def _answers(
        self,
        model: Any,
        tokenizer: Any,
        grader: ScoreModelGrader,
        conversations: Sequence[list[dict[str, str]]],
    ) -> list[str]:
        from trainer.data.prompts import render_prompt
        from trainer.rollout.base import SamplingParams
        from trainer.rollout.hf_engine import HFEngine

        sampling = grader.sampling_params
        prompts = [tokenizer(render_prompt(c, tokenizer)).input_ids for c in conversations]
        params = SamplingParams(
            max_new_tokens=sampling.max_completions_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            greedy=sampling.temperature == 0,
            seed=sampling.seed,
        )
        completions = HFEngine(model, tokenizer, device=self.device).generate(prompts, 1, params)
        return [c.text for c in completions]
