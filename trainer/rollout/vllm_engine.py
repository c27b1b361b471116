"""Rollouts with vLLM (GPU only, optional extra): paged KV cache and continuous batching, colocated with the
policy in the worker process.

vLLM pins its own torch and transformers, so it lives in a separate GPU environment (``pip install
'rlrun[vllm]'``) and is imported only inside ``VllmEngine.__init__``: importing this module never needs it.
Everything that turns vLLM's output into ``Completion`` objects is pure (``completions_from_vllm``,
``sampling_kwargs``) and tested on CPU with plain objects of vLLM's shape.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Sequence
from typing import Any

from trainer.rollout.base import Completion, FinishReason, SamplingParams, check_generate_args

INSTALL_HINT = "pip install 'rlrun[vllm]' in a GPU environment (vLLM pins torch; see docs/settings.md)"

# vLLM's finish reasons; "abort" (request cancelled) and anything else is an error, never a rollout.
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "eos", "length": "length"}


def vllm_available() -> bool:
    """Whether ``import vllm`` would find the package (without importing it, which initialises CUDA)."""
    return importlib.util.find_spec("vllm") is not None


def sampling_kwargs(params: SamplingParams, n: int) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` matching ``params``.

    Greedy is ``temperature=0`` in vLLM. ``top_k=-1`` switches top-k off (older vLLM rejects 0).
    ``logprobs=0`` asks for the log-probability of the sampled token only.
    """
    greedy = params.is_greedy
    return {
        "n": n,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": -1 if greedy or params.top_k == 0 else params.top_k,
        "max_tokens": params.max_new_tokens,
        "seed": params.seed,
        "logprobs": 0,
    }


def completions_from_vllm(
    outputs: Sequence[Any], prompts: Sequence[list[int]], tokenizer: Any
) -> list[Completion]:
    """Turn ``LLM.generate`` results into completions, prompt-major.

    Reads only plain attributes of vLLM's ``RequestOutput``: ``prompt_token_ids`` and ``outputs``, each with
    ``token_ids``, ``text``, ``finish_reason`` (``"stop"`` -> ``"eos"``, ``"length"`` -> ``"length"``),
    ``logprobs`` (per position a dict ``token_id -> obj with .logprob``, or ``None``) and, when present,
    ``index`` (sample order within the request; vLLM may finish samples out of order).

    vLLM keeps the EOS token in ``token_ids`` when it stops on it, as ``Completion`` wants. ``tokenizer`` is
    only used to decode when vLLM was told not to detokenize (``text is None``).

    Raises:
        ValueError: the outputs do not line up with ``prompts`` (count or token ids), an unknown finish
            reason (e.g. ``"abort"``), or a logprob entry missing for a generated token.
    """
    if len(outputs) != len(prompts):
        raise ValueError(f"vLLM returned {len(outputs)} request outputs for {len(prompts)} prompts")
    completions: list[Completion] = []
    for i, (request, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        if list(request.prompt_token_ids) != list(prompt):
            raise ValueError(f"request output {i} is for a different prompt than prompts[{i}]")
        samples = sorted(enumerate(request.outputs), key=lambda pair: getattr(pair[1], "index", pair[0]))
        for _, sample in samples:
            if sample.finish_reason not in _FINISH_REASONS:
                raise ValueError(f"prompt {i}: vLLM finished a sample with {sample.finish_reason!r}")
            token_ids = list(sample.token_ids)
            text = (
                sample.text
                if sample.text is not None
                else tokenizer.decode(token_ids, skip_special_tokens=True)
            )
            completions.append(
                Completion(
                    prompt_index=i,
                    prompt_ids=list(prompt),
                    token_ids=token_ids,
                    text=text,
                    finish_reason=_FINISH_REASONS[sample.finish_reason],
                    logprobs=_sampled_logprobs(sample.logprobs, token_ids, i),
                )
            )
    return completions


def _sampled_logprobs(logprobs: Any, token_ids: list[int], prompt_index: int) -> list[float] | None:
    """The sampled token's log-probability at each position, from vLLM's per-position top-k dicts."""
    if logprobs is None:
        return None
    if len(logprobs) != len(token_ids):
        raise ValueError(
            f"prompt {prompt_index}: {len(logprobs)} logprob entries for {len(token_ids)} tokens"
        )
    out: list[float] = []
    for pos, (entry, token) in enumerate(zip(logprobs, token_ids, strict=True)):
        if token not in entry:
            raise ValueError(
                f"prompt {prompt_index}: no logprob for generated token {token} at position {pos}"
            )
        out.append(float(entry[token].logprob))
    return out


class VllmEngine:
    """``RolloutEngine`` over an in-process ``vllm.LLM`` sharing the GPU with the policy ("colocate").

    Args:
        model_path: folder or hub id of the policy's starting weights (vLLM loads its own copy).
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache); the rest is left to
            the policy, its optimizer and activations.
        dtype: vLLM's weight dtype.
        seed: vLLM's engine seed (requests without ``SamplingParams.seed`` draw from it).

    Raises:
        ImportError: vLLM is not installed, naming the extra to install.
    """

    def __init__(
        self, model_path: str, *, gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16", seed: int = 0
    ):
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(f"VllmEngine needs vLLM, which is not installed: {INSTALL_HINT}") from exc
        self._vllm = vllm
        _ensure_single_process_group_env()
        # Built as TRL's colocate mode does (trl/generation/vllm_generation.py: VLLMGeneration._init_vllm).
        # "external_launcher" keeps the engine core and its worker in this process, which is what makes the
        # in-place load_weights in sync_weights possible. "processed_logprobs" reports log-probabilities of
        # the distribution actually sampled (after temperature/top-p/top-k): the behaviour policy for ratios.
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",
        )
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """n completions per prompt, prompt-major, with the sampled tokens' log-probabilities."""
        check_generate_args(prompts, n)
        if not prompts:
            return []
        sampling = self._vllm.SamplingParams(**sampling_kwargs(params, n))
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in prompts], sampling_params=sampling, use_tqdm=False
        )
        return completions_from_vllm(outputs, prompts, self.tokenizer)

    def sync_weights(self, model: Any) -> None:
        """Copy the policy's current weights into vLLM's model, in place.

        The colocate path of TRL (trl/generation/vllm_generation.py: ``VLLMGeneration.sync_weights``):
        ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(...)`` with HF parameter
        names (vLLM's ``load_weights`` maps them onto its fused layers, e.g. q/k/v -> qkv_proj), then
        ``llm.reset_prefix_cache()`` because cached KV blocks were computed with the old weights. It reaches
        into vLLM internals and needs the in-process engine built in ``__init__``. vLLM >= 0.22 also has a
        native API (``WeightTransferConfig(backend="ipc")`` + ``update_weights``; docs.vllm.ai
        "training/weight_transfer"), but its trainer-side calls changed between 0.29 and 0.32, so the
        long-standing path is used until a pinned vLLM is tested here on a GPU.
        """
        runner_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        runner_model.load_weights(weights=((name, t.detach()) for name, t in model.state_dict().items()))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """The in-process engine goes with this process."""


def _ensure_single_process_group_env() -> None:
    """``external_launcher`` joins a torch.distributed group from the usual env vars; a worker that is not
    launched by torchrun has none, so default to a one-process group on a free local port."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
