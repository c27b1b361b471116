"""rlrun's SimPO and ORPO losses against TRL's on the same inputs (the peer named in issue 22).

TRL keeps these losses on its trainers: SimPO is ``CPOTrainer.cpo_loss`` with ``loss_type="simpo"`` and
ORPO's odds-ratio term is ``ORPOTrainer.odds_ratio_loss`` (``trl.experimental``). Both read only a few
attributes of the trainer, so they are called here unbound on a stand-in holding those attributes (no
model, no trainer set-up), on the same random batches of mean token log-probs (what both feed them, TRL
with ``average_log_prob``), over a grid of beta and gamma.

- SimPO: rlrun ``simpo(c, r, PreferenceParams(beta, gamma))`` vs TRL ``cpo_loss(c, r)[0]`` (its
  ``logits - gamma / beta`` inside ``beta *`` is the same value as rlrun's ``beta (c - r) - gamma``).
- ORPO: rlrun ``orpo_odds_ratio(c, r, PreferenceParams(beta=lambda))`` is ``lambda * L_OR``; TRL returns
  ``beta * log sigmoid(log odds)``, which its trainer subtracts from the NLL: rlrun's = ``-TRL's``.

KTO is not compared here: TRL computes it inline in ``KTOTrainer._compute_loss`` (no callable loss);
tests/algorithms/test_kto.py transcribes that formula (``1 - sigmoid(beta (r - KL))`` weighted) instead.

Prints the largest absolute and relative difference per loss; the goal is float64 agreement (< 1e-12).
Run: ``.venv/bin/python bench/preference_losses_vs_trl.py`` (needs the bench extra: TRL).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from trainer.algorithms.preference_losses import PreferenceParams, orpo_odds_ratio, simpo

BATCHES = 20
BATCH = 64


def main() -> None:
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    gen = torch.Generator().manual_seed(0)
    worst = {"simpo": (0.0, 0.0), "orpo": (0.0, 0.0)}
    for beta in (0.1, 0.5, 2.0, 2.5):
        for gamma in (0.0, 0.5, 1.6):
            for _ in range(BATCHES):
                c = -torch.rand(BATCH, generator=gen, dtype=torch.float64) * 4 - 1e-3
                r = -torch.rand(BATCH, generator=gen, dtype=torch.float64) * 4 - 1e-3
                trainer = SimpleNamespace(
                    alpha=0.0,
                    beta=beta,
                    loss_type="simpo",
                    simpo_gamma=gamma,
                    label_smoothing=0.0,
                    accelerator=SimpleNamespace(device="cpu"),
                )
                theirs = CPOTrainer.cpo_loss(trainer, c, r)[0]
                ours = simpo(c, r, PreferenceParams(beta=beta, gamma=gamma))
                worst["simpo"] = track(worst["simpo"], ours, theirs)
                trainer_orpo = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device="cpu"))
                theirs_or = -ORPOTrainer.odds_ratio_loss(trainer_orpo, c, r)[0].double()
                ours_or = orpo_odds_ratio(c, r, PreferenceParams(beta=beta))
                worst["orpo"] = track(worst["orpo"], ours_or, theirs_or)
    print(f"{'loss':>6} | {'max abs diff':>12} | {'max rel diff':>12} | inputs")
    for name, (absolute, relative) in worst.items():
        print(
            f"{name:>6} | {absolute:>12.3e} | {relative:>12.3e} | {BATCHES * 12} batches of {BATCH}, "
            "beta 0.1-2.5, gamma 0-1.6"
        )
    print("note: TRL's odds_ratio_loss works in float32 (it casts its inputs), so ORPO agrees to float32")


def track(worst: tuple[float, float], ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    diff = (ours - theirs).abs()
    rel = diff / theirs.abs().clamp(min=1e-30)
    return max(worst[0], float(diff.max())), max(worst[1], float(rel.max()))


if __name__ == "__main__":
    main()
