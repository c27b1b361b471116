"""Scalar rewards from a trained reward model (a ``reward_model`` run's checkpoint) for prompt + completion.

A sequence is built and scored exactly as the reward-model loop built and scored its training data
(``trainer.data.reward.tokenize_group`` and ``trainer.models.sequence_scores``): the
prompt text tokenized with the tokenizer's special tokens, then the completion without them plus EOS
(unless EOS is the pad token), the completion keeping its first ``max_length`` tokens and the prompt cut
from the left to fill the rest; the score is the head's output at the last non-pad token of the
right-padded batch. The completion gets EOS even when generation was truncated, as every training
response did: the reward model never saw a sequence without one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainer.data.reward import TokenizedGroup, collate_groups, tokenize_group
from trainer.models import load_reward_model, pick_device, read_reward_stats, sequence_scores

log = logging.getLogger("rlrun.rewards")

NORMALIZE_EPS = 1e-8


class RewardModelScorer:
    """A reward model loaded once, in eval mode with gradients off, scoring batches of completions.

    Args:
        path: a folder (or hub id) that ``load_reward_model`` can load, e.g. a reward_model run's final
            checkpoint.
        normalize: standardise scores with the ``reward_stats.json`` stored next to the model:
            ``(s - mean) / (std + 1e-8)``. Without that file scores stay raw and ``normalized`` is False.
        device: where the model runs (default: CUDA if available, else CPU).
        batch_size: sequences per forward pass (sequences are sorted by length to pad little).
        max_length: longest scored sequence in tokens (default: the model's ``max_position_embeddings``);
            pass the reward-model run's ``max_length`` to score exactly as it was trained.

    Attributes:
        normalized: whether ``score`` standardises (``normalize`` and a stats file was found).
        mean, std: the statistics used (0 and 1 when not normalising).
    """

    def __init__(
        self,
        path: str,
        *,
        normalize: bool = True,
        device: torch.device | None = None,
        batch_size: int = 32,
        max_length: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = device if device is not None else pick_device()
        self.batch_size = batch_size
        model, self.tokenizer = load_reward_model(path)
        self.model: Any = model.to(self.device).eval().requires_grad_(False)
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        stats = read_reward_stats(path) if normalize else None
        if normalize and stats is None:
            log.warning("no reward statistics next to %s: reward-model scores are not normalised", path)
        self.normalized = stats is not None
        self.mean = float(stats["mean"]) if stats is not None else 0.0
        self.std = float(stats["std"]) if stats is not None else 1.0

    def tokenize(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        """Token ids of each ``prompt + completion`` as the reward-model loop builds them (module doc).

        Completions of one prompt go through ``tokenize_group`` together, so each prompt is tokenized once.
        """
        by_prompt: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_prompt.setdefault(prompt, []).append(i)
        sequences: list[list[int]] = [[] for _ in prompts]
        for prompt, indices in by_prompt.items():
            responses = [completions[i] for i in indices]
            if len(responses) == 1:  # a ranking group needs two responses; the copy is dropped below
                responses = responses * 2
            group = tokenize_group(
                {"prompt": prompt, "responses": responses},
                "ranking",
                self.tokenizer,
                max_length=self.max_length,
            )
            for i, sequence in zip(indices, group.sequences, strict=False):
                sequences[i] = sequence
        return sequences

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """One score per ``(prompt, completion)``, normalised if ``normalized``.

        Args:
            prompts: rendered prompt texts (passed through as is).
            completions: decoded completion texts, special tokens stripped.

        Raises:
            ValueError: ``prompts`` and ``completions`` differ in length, or a pair is empty on both sides.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        sequences = self.tokenize(prompts, completions)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]), reverse=True)
        raw = [0.0] * len(sequences)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            batch = collate_groups([TokenizedGroup(sequences=[sequences[i]]) for i in chunk], self.pad_id)
            for i, s in zip(chunk, sequence_scores(self.model, batch, self.device).tolist(), strict=True):
                raw[i] = float(s)
        if not self.normalized:
            return raw
        return [(s - self.mean) / (self.std + NORMALIZE_EPS) for s in raw]

    @property
    def pad_id(self) -> int:
        pad: int = self.tokenizer.pad_token_id
        return pad
