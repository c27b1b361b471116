"""One step off-policy rollouts (``async_rollouts: 1``): the next step's rollouts are generated while the
trainer updates on this step's (verl's one-step-off-policy trainer; PipelineRL, Piche et al. 2025).

With θ_k the policy after step k's update, step k runs:

    take ro_k (sampled from θ_{k-2}, started during step k-1) -> sync θ_{k-1} to the engine
    -> start ro_{k+1} in the background -> old log-probs (θ_{k-1}) -> update on ro_k -> θ_k

so every update trains on rollouts one update older than the policy it starts from; the first step (and
the first after a resume) generates in the foreground. The policy ratio π_θ / π_old uses old log-probs
recomputed with θ_{k-1} (the no-grad pass every step with engine log-probs takes), and
``importance_sampling_cap`` C weights each token's policy term by min(π_old / π_sampler, C), which covers
the lag as well as the kernels' mismatch (Yao et al. 2025; trainer/algorithms/sampler_correction.py); the
``mismatch/*`` metrics show how far the sampler was.

Rules that keep it exact and safe:
- The engine's weights change only while it is not generating: every sync (the next step's, an eval's)
  first waits for the background rollouts (``settle``).
- The background rollouts draw their prompts from a copy of the run's prompt sampler (with a clone of its
  generator), adopted when they are taken: a checkpoint written at the end of step k holds the sampler
  before step k+1's draws, so a run resumed there draws the same prompts for step k+1 (from θ_k's weights:
  a resumed run is not bitwise the uninterrupted one). The minibatch shuffles, which share that generator
  on the plain path, get one of their own (trainer/loops/rl_common.py ``sample_step``).
- A run stopped mid-step (cancel, pause, failure) stops the background generation with ``RunStopped``
  raised into its thread (the engine client waits in short slices and aborts its requests), and waits for
  the thread before the engine is closed.
- Only engines in a process of their own (``vllm_server``): the transformers engine generates with the
  very model being updated (refused at submit, trainer/specs/online.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.data.prompts import PromptSet
from trainer.data.sampling import EpochSampler
from trainer.loops.rollouts import StepRollouts, collect_rollouts
from trainer.phases import RunStopped
from trainer.rewards.composite import CompositeReward
from trainer.rollout.base import RolloutEngine
from trainer.stop_watch import raise_in_thread

WAIT_SLICE_S = 0.2

if TYPE_CHECKING:
    from trainer.specs import OnlineRlHyperparameters


def clone_sampler(sampler: EpochSampler) -> EpochSampler:
    """A copy of ``sampler`` with its own generator in the same state: drawing from it leaves ``sampler``
    (and anything else sharing its generator) as it was."""
    gen = torch.Generator(device=sampler.gen.device)
    copy = EpochSampler(sampler.n, sampler.batch_size, gen)
    copy.load_state_dict(sampler.state_dict())
    return copy


@dataclass
class Prefetched:
    """Rollouts generated in the background, the sampler that drew their prompts, and how long they took."""

    rollouts: StepRollouts
    sampler: EpochSampler
    seconds: float


class _Generation(threading.Thread):
    """One step's rollouts on a thread of their own; the result or the exception is kept for ``take``."""

    def __init__(self, work: Callable[[], Prefetched]):
        super().__init__(name="rlrun-rollouts", daemon=True)
        self._work = work
        self.result: Prefetched | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self._work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the loop's thread by ``take``
            self.error = exc
        finally:
            self.done.set()


def wait_in_slices(thread: _Generation) -> None:
    """Wait until ``thread``'s work is done, in short slices: a cancel raised into the waiting thread
    (trainer/stop_watch.py) lands between two of them. (Not ``Thread.join``: an exception raised into a
    thread inside ``join`` makes CPython 3.11 mark the joined thread stopped while it still runs.)"""
    while not thread.done.wait(WAIT_SLICE_S) and thread.is_alive():
        pass  # (is_alive: a stop raised into it as it ended may have skipped setting ``done``)


class RolloutPrefetch:
    """At most one step's rollouts generating in the background while the loop trains.

    Args:
        engine: the run's rollout engine (in a process of its own).
        prompts: the run's training prompts.
        reward: the run's reward.
        hp: the run's sampling and dynamic-sampling settings.
        seed_of: the rollout seed of a step (the foreground path's own).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: PromptSet,
        reward: CompositeReward,
        hp: OnlineRlHyperparameters,
        *,
        seed_of: Callable[[int], int],
    ) -> None:
        self.engine, self.prompts, self.reward, self.hp, self.seed_of = engine, prompts, reward, hp, seed_of
        self._pending: tuple[int, _Generation] | None = None

    def start(self, step: int, sampler: EpochSampler, *, greedy_baseline: bool) -> None:
        """Start step ``step``'s rollouts from the engine's current weights, drawing prompts from a copy of
        ``sampler``; ``greedy_baseline``: also a greedy rollout per prompt (ReMax)."""
        if self._pending is not None:
            raise RuntimeError(f"step {self._pending[0]}'s rollouts are still pending")
        mine = clone_sampler(sampler)

        def work() -> Prefetched:
            t0 = time.perf_counter()
            rollouts = collect_rollouts(
                self.engine,
                self.prompts,
                mine,
                self.reward,
                self.hp,
                greedy_baseline=greedy_baseline,
                seed=self.seed_of(step),
            )
            return Prefetched(rollouts, mine, time.perf_counter() - t0)

        thread = _Generation(work)
        thread.start()
        self._pending = (step, thread)

    def take(self, step: int, sampler: EpochSampler) -> Prefetched | None:
        """Step ``step``'s background rollouts, once done (None when none were started for it); ``sampler``
        takes the copy's state (the prompts they drew count as drawn). A failure in the background is
        raised here."""
        if self._pending is None:
            return None
        pending, thread = self._pending
        if pending != step:
            raise RuntimeError(f"rollouts were started for step {pending}, not {step}")
        wait_in_slices(thread)
        self._pending = None
        if thread.error is not None:
            raise thread.error
        assert thread.result is not None
        sampler.load_state_dict(thread.result.sampler.state_dict())
        return thread.result

    def settle(self) -> None:
        """Wait until the background rollouts (if any) are done, so the engine's weights may change."""
        if self._pending is not None:
            wait_in_slices(self._pending[1])

    def close(self) -> None:
        """Stop a background generation still running (the run stopped mid-step) and wait for its thread."""
        if self._pending is None:
            return
        _, thread = self._pending
        self._pending = None
        if not thread.done.is_set() and thread.ident is not None:
            raise_in_thread(thread.ident, RunStopped)
        wait_in_slices(thread)
        thread.join()
