"""The Tinker SDK's built-in losses (``forward_backward(data, loss_fn=...)``), per datum, on the log-probs
the model gives the datum's target tokens. Pure tensor math; the policy-gradient ones are rlrun's own
(trainer/algorithms/policy_losses.py), summed over tokens as Tinker sums them.

For a datum with input tokens ``x`` (N) and ``target_tokens`` ``y`` (N), ``lp_t = log pi(y_t | x_<=t)``;
with ``logprobs`` ``q_t`` (the sampler's) and ``advantages`` ``A_t``, ``r_t = exp(lp_t - q_t)``:

- ``cross_entropy``: ``L = -sum_t w_t lp_t`` (``weights`` w, default 1);
- ``importance_sampling``: ``L = -sum_t r_t A_t`` (REINFORCE with an importance weight; on-policy its
  gradient is ``-sum_t A_t grad lp_t``) — ``policy_losses.vanilla``;
- ``ppo``: ``L = -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)`` (Schulman et al. 2017, eq. 7), ``lo`` and ``hi``
  from ``loss_fn_config`` ``clip_low_threshold`` / ``clip_high_threshold`` (default 0.8 / 1.2, Tinker's
  epsilon 0.2) — ``policy_losses.ppo_clip``;
- ``cispo``: ``L = -sum_t sg(clip(r_t, lo, hi)) A_t lp_t`` (MiniMax-M1, eq. 4-5), the same thresholds —
  ``policy_losses.cispo``.

Each returns the per-token loss (its sum is the datum's loss, reported as ``loss:sum`` over the batch), so
a caller can send it back as ``elementwise_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from trainer.algorithms.policy_losses import ClipParams, cispo, ppo_clip, vanilla
from trainer.primitives.wire import Datum, WireError

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # loss -> (required, optional) inputs
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (RL_INPUTS, ()),
    "ppo": (RL_INPUTS, ()),
    "cispo": (RL_INPUTS, ()),
}
CONFIG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # ppo's and cispo's, with defaults


def check_datum(loss_fn: str, datum: Datum, where: str) -> None:
    """Refuse a datum ``loss_fn`` cannot read: a loss this server does not have, missing or unknown
    inputs, or inputs that are not one value per input token.

    Raises:
        WireError: naming the field (``loss_fn`` or ``data[i].loss_fn_inputs.<name>``).
    """
    if loss_fn not in INPUTS:
        raise WireError(f"{loss_fn!r} is not supported; the losses are: {', '.join(INPUTS)}", "loss_fn")
    required, optional = INPUTS[loss_fn]
    for name in required:
        if name not in datum.inputs:
            raise WireError(f"{loss_fn} needs {', '.join(required)}", f"{where}.loss_fn_inputs.{name}")
    n = len(datum.tokens)
    for name, t in datum.inputs.items():
        field = f"{where}.loss_fn_inputs.{name}"
        if name not in required + optional:
            raise WireError(f"{loss_fn} takes {', '.join(required + optional)}; not {name}", field)
        if tuple(t.shape) != (n,):
            raise WireError(
                f"shape {list(t.shape)}, but the datum has {n} input tokens: one value each", field
            )


def check_config(loss_fn: str, config: Mapping[str, float | str]) -> ClipParams | None:
    """The clip of ``ppo`` / ``cispo`` from ``loss_fn_config`` (None for the others).

    Raises:
        WireError: an unknown key, or thresholds that do not satisfy ``0 <= low <= 1 < high``.
    """
    for key in config:
        if key not in CONFIG or loss_fn not in ("ppo", "cispo"):
            raise WireError(f"{loss_fn} takes no {key!r}", f"loss_fn_config.{key}")
    if loss_fn not in ("ppo", "cispo"):
        return None
    values = {k: config.get(k, d) for k, d in CONFIG.items()}
    if not all(isinstance(v, int | float) for v in values.values()):
        raise WireError("the clip thresholds must be numbers", "loss_fn_config")
    low, high = float(values["clip_low_threshold"]), float(values["clip_high_threshold"])
    if not 0.0 <= low <= 1.0 < high:
        raise WireError(
            f"need 0 <= clip_low_threshold <= 1 < clip_high_threshold, got {low}, {high}", "loss_fn_config"
        )
    return ClipParams(low=1.0 - low, high=high - 1.0)


def per_token_loss(
    loss_fn: str, logprobs: Tensor, inputs: Mapping[str, Tensor], clip: ClipParams | None
) -> Tensor:
    """The datum's per-token loss (N,), differentiable through ``logprobs`` (N,), the model's log-probs of
    the datum's ``target_tokens`` (module docstring has the formulas)."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        w = torch.ones_like(logprobs) if weights is None else weights.to(logprobs)
        return -w * logprobs
    lp, q = logprobs.unsqueeze(0), inputs["logprobs"].to(logprobs).unsqueeze(0)
    adv = inputs["advantages"].to(logprobs).unsqueeze(0)
    mask = torch.ones_like(lp, dtype=torch.bool)
    if loss_fn == "importance_sampling":
        out = vanilla(lp, q, adv, mask, clip=ClipParams())
    elif loss_fn == "ppo":
        assert clip is not None
        out = ppo_clip(lp, q, adv, mask, clip=clip)
    elif loss_fn == "cispo":
        assert clip is not None
        out = cispo(lp, q, adv, mask, clip=clip)
    else:
        raise WireError(f"{loss_fn!r} is not supported", "loss_fn")
    return out.per_token[0]
