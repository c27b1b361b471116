"""An online-RL run trained through your own agent program: the run hands each episode to an agent outside
rlrun, which plays it against an OpenAI-compatible endpoint served by the run's policy and posts the
episode's reward (trainer/rollout/agent_episodes.py; docs/runs.md, "Bring your own agent"). Torch-free (the
API validates it)."""

from __future__ import annotations

from pydantic import Field

from trainer.specs.base import _Frozen


class AgentSpec(_Frozen):
    """Episodes played by an agent program: it takes an episode (its dataset row) from
    ``GET /v1/runs/{id}/agent/episodes/next``, makes chat completion calls against the episode's
    ``base_url`` and posts its reward. Every call is recorded with its token ids; the calls of one
    episode become one training sample sharing the episode's advantage, the policy's tokens trained and
    everything else masked (docs/algorithms.md, "Bring your own agent")."""

    timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="Seconds a step's episodes may take, all together, from when they are offered until "
        "their rewards are in; an episode still open then is counted as timed out (`episode/timeout_frac`) "
        "and its group trains nothing that step.",
    )
    max_turns: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Chat completion calls per episode, at most (a call past it is refused).",
    )
    max_episode_tokens: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="Tokens after the episode's first prompt: the policy's replies and the messages the "
        "agent adds between calls, together. Default: max_turns x hyperparameters.max_new_tokens.",
    )

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The episode's token budget after its first prompt."""
        return self.max_episode_tokens or self.max_turns * max_new_tokens
