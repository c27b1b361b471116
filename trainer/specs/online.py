"""Online RL run specs: the group family (GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE, ReMax) and PPO / VC-PPO.

An algorithm name is a preset: it fills the hyperparameters it names (``GROUP_PRESETS``, ``PPO_PRESETS``)
unless the user gave them. The fill happens before validation (``_with_preset``), so a validated spec is
complete: no preset field is ever None, loops read every value as it is, and the stored spec is the
resolved one. Torch-free (the API imports it).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from trainer.specs.agents import AgentSpec
from trainer.specs.base import (
    AdvantageName,
    AggregationName,
    EngineName,
    KlControllerName,
    KlEstimatorName,
    PolicyLossName,
    TrainingHyperparameters,
    _Frozen,
    _ReferencedSpecBase,
)
from trainer.specs.environments import EnvironmentSpec
from trainer.specs.graders import Grader
from trainer.specs.refs import (
    CRITIC_MODEL_REFERENCE,
    DATASET_REFERENCE,
    MODEL_REF_DOC,
    REWARD_MODEL_REFERENCE,
    check_model_ref,
    refuse_nul,
)
from trainer.specs.tools import ToolsSpec

PRESET_MARK = "x-rlrun-preset"
# Completion tokens per sample, for online RL and for eval runs alike, so an eval before and after a run
# scores answers of the length the run trained on (eval runs had 256).
DEFAULT_MAX_NEW_TOKENS = 64


def _preset_field_schema(schema: dict[str, Any]) -> None:
    """A preset field's schema names no default (the algorithm's preset supplies it) and carries a mark."""
    schema.pop("default", None)
    schema[PRESET_MARK] = True


def preset_field(default: Any, description: str, **constraints: Any) -> Any:
    """A hyperparameter the algorithm's preset fills when the user leaves it out. ``default`` only serves
    hyperparameters built outside a spec (the spec always applies its preset first)."""
    return Field(
        default=default,
        description=description + " Default: the algorithm's preset.",
        json_schema_extra=_preset_field_schema,
        **constraints,
    )


def _with_preset(data: Any, preset: Mapping[str, Any]) -> Any:
    """Raw spec input with every preset hyperparameter the user left out (or sent as null) taken from
    ``preset``; anything else is returned as it is, for validation to refuse."""
    if not isinstance(data, dict):
        return data
    hp = data.get("hyperparameters", {})
    if isinstance(hp, BaseModel):  # built in Python: only the fields its author set count as given
        hp = {k: getattr(hp, k) for k in hp.model_fields_set}
    if not isinstance(hp, dict):
        return data
    given = {k: v for k, v in hp.items() if not (k in preset and v is None)}
    return {**data, "hyperparameters": {**preset, **given}}


# Advantages that compare the completions of one prompt: with one completion each is its own baseline and
# every advantage is 0 (nothing is learned). REINFORCE, REINFORCE++, ReMax and PPO have other baselines.
GROUP_BASELINE_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_baseline"})

VerifierName = Literal["exact_match", "numeric", "regex", "format", "length_penalty", "overlong_penalty"]
GroupAlgorithm = Literal[
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "cispo",
    "rloo",
    "reinforce",
    "reinforce_pp",
    "reinforce_baseline",
    "remax",
]


class RewardSpec(_Frozen):
    """One reward component: a rule-based verifier, a reward model or a grader, weighted into the total."""

    name: VerifierName | Literal["reward_model", "grader"] = Field(
        description="exact_match, numeric (last number, `#### N` or `\\boxed{}`), regex, format "
        "(<think>...</think><answer>...</answer>), length_penalty, overlong_penalty (DAPO), reward_model, or "
        "grader (implied by `grader`)."
    )
    grader: Grader | None = Field(
        default=None,
        description="An OpenAI-shaped grader (string_check, text_similarity, python, multi) scoring each "
        "completion against its dataset row (docs/algorithms.md, 'Graders'); `name` may be left out.",
    )
    weight: float = Field(default=1.0, ge=-100, le=100, description="Multiplier in the weighted sum.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description='Verifier keyword arguments, e.g. {"tolerance": 1e-6} for numeric, {"pattern": ...} '
        'for regex, {"cache_tokens": 16} for overlong_penalty, {"target_tokens": 32} for length_penalty.',
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="reward_model only: `run:<id>` of a reward-model run (`stage:<name>` in a pipeline), or "
        "a model folder whose config names a `...ForSequenceClassification` architecture.",
        json_schema_extra=REWARD_MODEL_REFERENCE,
    )
    normalize: bool = Field(
        default=True, description="reward_model only: standardise scores with the run's stored mean and std."
    )

    @model_validator(mode="before")
    @classmethod
    def _grader_names_itself(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("grader") is not None and data.get("name") is None:
            return {**data, "name": "grader"}
        return data

    @model_validator(mode="after")
    def _model_iff_reward_model(self) -> RewardSpec:
        if (self.name == "reward_model") != (self.model is not None):
            raise ValueError("`model` is required for name 'reward_model' and not allowed otherwise")
        if (self.name == "grader") != (self.grader is not None):
            raise ValueError("`grader` is required for name 'grader' and not allowed otherwise")
        if self.grader is not None and self.params:
            raise ValueError("params: a grader takes its settings in `grader`, not `params`")
        if self.model is not None:
            check_model_ref(self.model)
        return self

    @field_validator("params")
    @classmethod
    def _params_without_nul(cls, v: dict[str, Any]) -> dict[str, Any]:
        return refuse_nul(v, "params")  # type: ignore[no-any-return]


class OnlineRlHyperparameters(TrainingHyperparameters):
    """Online RL: sample -> reward -> advantage -> clipped policy-gradient epochs (see docs/algorithms.md)."""

    max_steps: int = Field(
        default=100, ge=1, le=1_000_000, description="RL steps (each: rollouts + updates)."
    )
    prompts_per_step: int = Field(default=8, ge=1, le=4096, description="Prompts sampled per RL step.")
    samples_per_prompt: int = Field(default=4, ge=1, le=256, description="Completions per prompt (G).")
    max_prompt_length: int = Field(
        default=128, ge=1, le=65_536, description="Prompt tokens (cut from the left)."
    )
    max_new_tokens: int = Field(
        default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=65_536, description="Generation budget per completion."
    )
    temperature: float = Field(default=1.0, ge=0, le=10, description="Sampling temperature (0: greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0: off).")
    engine: EngineName = Field(
        default="hf",
        description="Rollout engine: hf (transformers generate), vllm (in-process, GPU extra) or vllm_server "
        "(vLLM's server as a separate process from the engine environment, `make engine`; any machine; "
        "a run's ranks share one).",
    )
    importance_sampling_cap: float | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Truncated importance sampling (Yao et al. 2025): each token's policy-gradient term is "
        "weighted by min(pi_trainer / pi_sampler, cap), correcting for the engine's kernels sampling a "
        "slightly different distribution than the trainer's (docs/algorithms.md). Needs an engine that "
        "reports log-probs (vllm, vllm_server); TRL and verl use 2. Default: off (the mismatch is logged "
        "either way).",
    )
    old_logprobs: Literal["recompute", "sampler"] = Field(
        default="recompute",
        description="Where the policy ratio's old log-probs come from. recompute: a no-grad pass of the "
        "trainer over each step's rollouts before its updates (the sampler's own log-probs then only feed "
        "the mismatch metrics and importance_sampling_cap). sampler: the engine's log-probs of the tokens "
        "it sampled, so the ratio is anchored on the distribution that really drew them and each step "
        "skips that pass (one forward pass fewer; verl's bypass mode, docs/algorithms.md). Needs an engine "
        "that reports log-probs (vllm, vllm_server).",
    )
    async_rollouts: int = Field(
        default=0,
        ge=0,
        le=1,
        description="1: generate the next step's rollouts while this step trains (one step off-policy: each "
        "update trains on rollouts sampled one update earlier, as verl's one-step-off-policy trainer and "
        "PipelineRL). Needs engine vllm_server (an engine in its own process); importance_sampling_cap "
        "corrects for the lag (docs/algorithms.md). 0: off.",
    )
    policy_loss: PolicyLossName = preset_field(
        "ppo_clip",
        "Policy loss: ppo_clip, vanilla, gspo (sequence-level ratio) or cispo (clipped IS weight).",
    )
    loss_aggregation: AggregationName = preset_field(
        "token_mean", "How per-token losses become one number (docs/algorithms.md)."
    )
    ppo_epochs: int = preset_field(1, "Passes over each step's rollouts.", ge=1, le=64)
    minibatches: int = preset_field(
        1,
        "Optimizer steps per pass: each step's rollouts are cut into this many minibatches (ignored when "
        "minibatch_size is set). With ppo_epochs 1 and 1 minibatch the update is on-policy and clipping "
        "never acts (docs/algorithms.md).",
        ge=1,
        le=256,
    )
    minibatch_size: int | None = Field(
        default=None,
        ge=1,
        description="Completions per optimizer step; overrides minibatches (default: a step's rollouts / "
        "minibatches).",
    )
    clip_low: float = preset_field(
        0.2,
        "Clip epsilon below 1 (ratio >= 1 - low); 1 sets no lower bound (CISPO's weight).",
        gt=0,
        le=1,
    )
    clip_high: float = preset_field(0.2, "Clip epsilon above 1; > clip_low is DAPO clip-higher.", gt=0, le=10)
    dual_clip: float | None = Field(
        default=None, gt=1, description="Dual-clip constant c > 1 (Ye et al. 2020)."
    )
    kl_coef: float = preset_field(0.0, "KL-to-reference coefficient.", ge=0, le=100)
    kl_estimator: KlEstimatorName = Field(default="k3", description="k1, k2, k3 or abs (Schulman 2020).")
    kl_placement: Literal["loss", "reward"] = Field(
        default="loss", description="KL as a loss term (GRPO) or folded into per-token rewards (RLHF recipe)."
    )
    kl_controller: KlControllerName = Field(default="fixed", description="fixed, or adaptive (Ziegler 2019).")
    kl_target: float = Field(default=6.0, gt=0, description="adaptive controller: target KL.")
    kl_horizon: int = Field(default=10_000, ge=1, description="adaptive controller: horizon.")
    entropy_coef: float = Field(default=0.0, ge=0, le=10, description="Entropy bonus coefficient.")
    dynamic_sampling: bool = preset_field(
        False, "Drop zero-variance groups and sample more prompts to refill (DAPO)."
    )
    max_refill_rounds: int = Field(
        default=3, ge=0, le=32, description="Extra sampling rounds to refill a step."
    )
    mask_truncated: bool = Field(default=False, description="Give completions cut at max_new_tokens no loss.")
    sample_every: int = Field(
        default=10, ge=0, description="Store sample completions every N steps (0: never)."
    )
    samples_to_store: int = Field(default=4, ge=0, le=64, description="How many completions to store then.")

    @model_validator(mode="after")
    def _fits(self) -> OnlineRlHyperparameters:
        if self.importance_sampling_cap is not None and self.engine == "hf":
            raise ValueError(
                "importance_sampling_cap needs an engine that reports its sampler's log-probs (vllm, "
                "vllm_server); engine 'hf' samples with the trainer's own model, so there is no mismatch "
                "to correct"
            )
        if self.old_logprobs == "sampler" and self.engine == "hf":
            raise ValueError(
                "old_logprobs 'sampler' needs an engine that reports its sampler's log-probs (vllm, "
                "vllm_server); engine 'hf' samples with the trainer's own model: use old_logprobs "
                "'recompute'"
            )
        if self.old_logprobs == "sampler" and self.importance_sampling_cap is not None:
            raise ValueError(
                "importance_sampling_cap with old_logprobs 'sampler': the cap weights pi_old / pi_sampler, "
                "which is 1 when the old log-probs are the sampler's (the ratio's clip bounds the mismatch "
                "instead); drop one of them"
            )
        if self.async_rollouts and self.engine != "vllm_server":
            raise ValueError(
                f"async_rollouts needs engine 'vllm_server' (an engine in a process of its own, generating "
                f"while the trainer updates); engine '{self.engine}' generates in the trainer's process"
                + (" with the very model being updated" if self.engine == "hf" else "")
            )
        if self.max_prompt_length + self.max_new_tokens > self.max_length:
            raise ValueError("max_prompt_length + max_new_tokens must not exceed max_length")
        # A group baseline with one sample is refused at submit with the root cause (every advantage is 0:
        # trainer/specs/__init__.py learning_problems), which this message would hide behind the preset.
        if self.dynamic_sampling and self.samples_per_prompt < 2 and not self.group_baseline:
            raise ValueError(
                "dynamic_sampling needs samples_per_prompt >= 2 (a group of one has no variance)"
            )
        step_batch = self.minibatch_size_for(self.prompts_per_step * self.samples_per_prompt)
        if self.micro_batch_size is not None and step_batch % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide the completions of one optimizer "
                f"step ({step_batch}: minibatch_size, else prompts_per_step x samples_per_prompt / "
                "minibatches, rounded up)"
            )
        return self

    @property
    def group_baseline(self) -> bool:
        """Whether the advantage compares the completions of one prompt (the group family overrides)."""
        return False

    def minibatch_size_for(self, n: int) -> int:
        """Completions per optimizer step when a step has ``n`` rollouts: ``minibatch_size`` if set, else
        ``ceil(n / minibatches)``."""
        return self.minibatch_size or max(1, -(-n // self.minibatches))

    def on_policy(self, n: int) -> bool:
        """One pass over one minibatch: the update's own forward pass gives the old log-probs, ratio = 1."""
        return self.ppo_epochs == 1 and self.minibatch_size_for(n) >= n


class GroupRlHyperparameters(OnlineRlHyperparameters):
    """The group family: advantages from the rewards of the G completions of each prompt (no critic)."""

    advantage: AdvantageName = preset_field("grpo", "Advantage estimator (docs/algorithms.md).")

    @property
    def group_baseline(self) -> bool:
        return self.advantage in GROUP_BASELINE_ADVANTAGES


# Update counts and dynamic sampling come from bench/learning.py (README "Does RL learn?"): with one
# epoch over one minibatch the ratio is always 1 and clipping never acts; 2 epochs x 2 minibatches (4
# updates per rollout batch; the clip can act on the last 3) with zero-variance groups dropped lifted GRPO's
# mean held-out gain on the addition task over 6 SFT starts from +12.6 points (min -3.5) to +30.8 (+3.5).
# reinforce and remax (no ratio, no clip) stay on-policy.
GROUP_PRESETS: dict[str, dict[str, Any]] = {
    # Shao et al. 2024 (DeepSeekMath): std-normalised group advantage, k3 KL in the loss, 1/|o| per sequence;
    # plus dynamic sampling (Yu et al. 2025), measured above.
    "grpo": {
        "advantage": "grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "seq_mean_token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.04,
        "dynamic_sampling": True,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    # Liu et al. 2025: no std division, no length normalisation (constant normaliser), no KL.
    "dr_grpo": {
        "advantage": "dr_grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "seq_mean_token_sum_norm",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": True,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    # Zheng et al. 2025: the clip on a length-normalised sequence ratio, with the paper's tiny sequence
    # bounds (3e-4 / 4e-4), per-sequence mean; off-policy updates (2 x 2) so the clip can act; no KL.
    "gspo": {
        "advantage": "grpo",
        "policy_loss": "gspo",
        "loss_aggregation": "seq_mean_token_mean",
        "clip_low": 0.0003,
        "clip_high": 0.0004,
        "kl_coef": 0.0,
        "dynamic_sampling": True,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    # MiniMax 2025: every token's REINFORCE gradient weighted by its clipped, stop-gradient IS ratio (no
    # lower bound, 1 + 0.28 above), token-level mean; no KL.
    "cispo": {
        "advantage": "grpo",
        "policy_loss": "cispo",
        "loss_aggregation": "token_mean",
        "clip_low": 1.0,
        "clip_high": 0.28,
        "kl_coef": 0.0,
        "dynamic_sampling": True,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    # Yu et al. 2025: clip-higher, token-level loss, dynamic sampling, no KL.
    "dapo": {
        "advantage": "grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "kl_coef": 0.0,
        "dynamic_sampling": True,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    "rloo": {
        "advantage": "rloo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": True,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    "reinforce": {
        "advantage": "reinforce",
        "policy_loss": "vanilla",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
        "ppo_epochs": 1,
        "minibatches": 1,
    },
    "reinforce_pp": {
        "advantage": "reinforce_pp",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    "reinforce_baseline": {
        "advantage": "reinforce_baseline",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    # Li et al. 2023: the greedy completion's reward is the baseline.
    "remax": {
        "advantage": "remax",
        "policy_loss": "vanilla",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.0,
        "dynamic_sampling": False,
        "ppo_epochs": 1,
        "minibatches": 1,
    },
}


class _OnlineRlSpecBase(_ReferencedSpecBase):
    dataset_id: uuid.UUID = Field(
        description="A dataset of kind `prompts` ({prompt, answer?, meta}).",
        json_schema_extra=DATASET_REFERENCE,
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        max_length=16,
        description="Reward components, summed; at least one, unless an `environment` gives the reward.",
    )
    eval_rewards: list[RewardSpec] | None = Field(
        default=None,
        description="Held-out metric on the validation prompts (greedy), e.g. exact_match; logged as "
        "`eval/accuracy` every `eval_every` steps. Default: the training rewards.",
    )
    tools: ToolsSpec | None = Field(
        default=None,
        description="Multi-turn tool rollouts: Python functions the policy may call; each sample becomes an "
        "episode of up to `tools.max_turns` turns, its tool results appended as tool messages and never "
        "trained on; the rewards score the final answer (docs/algorithms.md, 'Multi-turn tool rollouts'). "
        "Default: one turn, no tools.",
    )
    environment: EnvironmentSpec | None = Field(
        default=None,
        description="Multi-turn episodes driven by your environment code: `reset(row)` opens each episode, "
        "`step(messages, row)` answers each policy turn with messages, a reward and `done` "
        "(docs/runs.md, 'Environments'); its rewards add up as `reward/environment`. Not with `tools`.",
    )
    agent: AgentSpec | None = Field(
        default=None,
        description="Episodes played by your own agent program against an OpenAI-compatible endpoint of the "
        "policy: it takes episodes from `GET /v1/runs/{id}/agent/episodes/next`, calls the episode's "
        "`base_url` with the `openai` client and posts the reward, added up as `reward/agent` "
        "(docs/runs.md, 'Bring your own agent'). Not with `tools` or `environment`; one device.",
    )
    dataset_kinds: ClassVar[tuple[str, ...]] = ("prompts",)

    @model_validator(mode="after")
    def _episode_fits(self) -> _OnlineRlSpecBase:
        hp: OnlineRlHyperparameters = self.hyperparameters  # type: ignore[attr-defined]
        if self.tools is not None and self.environment is not None:
            raise ValueError("tools and environment: give one (an environment can run tools in its step)")
        if self.agent is not None and (self.tools is not None or self.environment is not None):
            raise ValueError("agent with tools or an environment: give one (your agent runs its own tools)")
        if not self.rewards and self.environment is None and self.agent is None:
            raise ValueError(
                "rewards: at least one reward component (only an environment or an agent gives its own)"
            )
        if self.agent is not None and self.resources.ranks > 1:
            raise ValueError(
                "agent with resources.devices > 1 (or nodes > 1) is not supported yet (one endpoint serves "
                "the policy; the ranks would each need the episodes their share holds): use one device"
            )
        if self.agent is not None and getattr(hp, "advantage", None) == "remax":
            raise ValueError(
                "agent with the remax advantage is not supported yet (its greedy baseline would be a "
                "second round of your agent's episodes per step): use rloo or grpo"
            )
        if self.agent is not None and hp.async_rollouts:
            raise ValueError(
                "agent with hyperparameters.async_rollouts is not supported yet (the agent's calls are "
                "served by the thread that trains): set async_rollouts false"
            )
        episodes = self.tools or self.environment or self.agent
        if episodes is not None and self.resources.ranks > 1 and self.resources.sharding == "fsdp":
            raise ValueError(
                "tools or an environment with resources.sharding 'fsdp' is not supported yet (each rank's "
                "episodes take a different number of turns, but a sharded model generates only when every "
                "rank does): use sharding 'ddp'"
            )
        if episodes is not None:
            budget = episodes.episode_tokens(hp.max_new_tokens)
            if hp.max_prompt_length + budget > hp.max_length:
                where = "tools" if self.tools is not None else "agent" if self.agent else "environment"
                raise ValueError(
                    f"max_prompt_length + the episode's tokens ({hp.max_prompt_length} + {budget}: "
                    f"{where}.max_episode_tokens, default max_turns x max_new_tokens) must not exceed "
                    f"hyperparameters.max_length ({hp.max_length})"
                )
        return self

    @model_validator(mode="after")
    def _engine_takes_the_adapter(self) -> _OnlineRlSpecBase:
        hp: OnlineRlHyperparameters = self.hyperparameters  # type: ignore[attr-defined]
        if self.adapter is not None and hp.engine == "vllm":
            raise ValueError(
                "adapter with engine 'vllm' is not supported yet (the in-process engine would need the "
                "adapter's weights at every step): use engine 'vllm_server' or 'hf', or train the whole model"
            )
        if self.adapter is not None and self.adapter.quantize is not None and hp.engine != "hf":
            raise ValueError(
                f"a quantized adapter base (adapter.quantize) with engine '{hp.engine}' is not supported "
                "(the engine would load the base unquantized): use engine 'hf'"
            )
        if self.resources.ranks > 1 and hp.engine == "vllm":
            raise ValueError(
                "engine 'vllm' on several devices is not supported yet (each rank would load its own "
                "in-process engine): use engine 'vllm_server' (one engine process the ranks share) or 'hf'"
            )
        if self.resources.ranks > 1 and hp.engine == "vllm_server" and hp.async_rollouts:
            raise ValueError(
                "engine 'vllm_server' on several devices with hyperparameters.async_rollouts is not "
                "supported yet (the ranks' background rollouts would meet in collectives out of step with "
                "their updates): set async_rollouts 0"
            )
        return self


class GroupRlSpec(_OnlineRlSpecBase):
    """Group / leave-one-out family: G completions per prompt, advantages from their rewards (no critic)."""

    algorithm: GroupAlgorithm = Field(
        description="Preset: grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce, reinforce_pp, "
        "reinforce_baseline, remax. Each fills advantage, policy_loss, loss_aggregation, clip_low, "
        "clip_high, kl_coef, dynamic_sampling, ppo_epochs and minibatches unless given."
    )
    hyperparameters: GroupRlHyperparameters = Field(default_factory=GroupRlHyperparameters)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        algorithm = data.get("algorithm") if isinstance(data, dict) else None
        return _with_preset(data, GROUP_PRESETS[algorithm]) if algorithm in GROUP_PRESETS else data

    def rank_split(self) -> tuple[str, int] | None:
        return "hyperparameters.prompts_per_step", self.hyperparameters.prompts_per_step

    @model_validator(mode="after")
    def _remax_baseline(self) -> GroupRlSpec:
        if self.hyperparameters.advantage == "remax" and self.algorithm != "remax":
            raise ValueError(
                "the remax advantage needs algorithm 'remax' (it adds the greedy baseline rollout)"
            )
        return self


PpoAlgorithm = Literal["ppo", "vc_ppo"]


class PpoHyperparameters(OnlineRlHyperparameters):
    """PPO with a learned critic and GAE (Schulman et al. 2017; Ouyang et al. 2022), and VC-PPO
    (Yuan et al. 2025: value pretraining, decoupled and length-adaptive lambda)."""

    samples_per_prompt: int = Field(default=1, ge=1, le=256, description="Completions per prompt.")
    kl_estimator: KlEstimatorName = Field(default="k1", description="k1, k2, k3 or abs (Schulman 2020).")
    kl_placement: Literal["loss", "reward"] = Field(
        default="reward", description="KL folded into per-token rewards (RLHF recipe) or added to the loss."
    )
    gamma: float = Field(default=1.0, gt=0, le=1, description="GAE discount.")
    lam: float = preset_field(0.95, "Actor GAE lambda.", ge=0, le=1)
    critic_lam: float = preset_field(
        0.95, "Critic (value target) GAE lambda; VC-PPO decouples it (1.0).", ge=0, le=1
    )
    length_adaptive_alpha: float | None = preset_field(
        None, "VC-PPO: actor lambda per sequence = 1 - 1/(alpha * length); null keeps `lam` fixed.", gt=0
    )
    value_clip: float | None = Field(
        default=0.2, gt=0, description="Clipped value loss range (None: unclipped)."
    )
    vf_coef: float = Field(default=0.5, gt=0, le=100, description="Value-loss weight.")
    critic_learning_rate: float | None = Field(
        default=None, gt=0, le=1.0, description="Critic AdamW learning rate (default: learning_rate)."
    )
    value_pretrain_steps: int = preset_field(
        0, "Steps that train only the critic before the actor.", ge=0, le=100_000
    )
    whiten_advantages: bool = Field(default=True, description="Standardise advantages over valid tokens.")


PPO_PRESETS: dict[str, dict[str, Any]] = {
    "ppo": {
        "lam": 0.95,
        "critic_lam": 0.95,
        "value_pretrain_steps": 0,
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.05,
        "dynamic_sampling": False,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
    # Yuan et al. 2025: critic lambda 1 (unbiased value targets), actor lambda adapted to the length,
    # and the value model pretrained on the initial policy's rollouts before any actor update.
    "vc_ppo": {
        "lam": 0.95,
        "critic_lam": 1.0,
        "length_adaptive_alpha": 0.05,
        "value_pretrain_steps": 10,
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl_coef": 0.05,
        "dynamic_sampling": False,
        "ppo_epochs": 2,
        "minibatches": 2,
    },
}


class PpoSpec(_OnlineRlSpecBase):
    """PPO family: token-level advantages from a critic (value head) with GAE."""

    algorithm: PpoAlgorithm = Field(description="Preset: ppo or vc_ppo (fills the fields left unset).")
    critic_model: str | None = Field(
        default=None,
        min_length=1,
        description="Critic initialisation: default the starting policy with a fresh value head; or a "
        "reward-model run (`run:<id>`), the InstructGPT recipe. " + MODEL_REF_DOC,
        json_schema_extra=CRITIC_MODEL_REFERENCE,
    )
    hyperparameters: PpoHyperparameters = Field(default_factory=PpoHyperparameters)

    @field_validator("critic_model")
    @classmethod
    def _check_critic(cls, v: str | None) -> str | None:
        return None if v is None else check_model_ref(v)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        hp = data.get("hyperparameters") if isinstance(data, dict) else None
        if isinstance(hp, dict) and hp.get("advantage") is not None:
            raise ValueError("PPO takes its advantages from GAE; `advantage` is for the group family")
        algorithm = data.get("algorithm") if isinstance(data, dict) else None
        return _with_preset(data, PPO_PRESETS[algorithm]) if algorithm in PPO_PRESETS else data
