"""Multi-turn tool rollouts: parsing calls, rendering tool turns, playing episodes over a scripted policy,
and which token positions train, checked against transcripts built by hand."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.graders.sandbox import isolation_problem
from trainer.loops.rl_common import to_token_batch
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.episodes import EpisodeLimits, MultiTurnEngine
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.tool_calls import ToolCall, parse_tool_calls
from trainer.rollout.tool_episodes import sandbox_runner, tool_episodes
from trainer.rollout.turn_format import TurnFormat

CALC = "def add(a, b):\n    return a + b\n"
# A ChatML-like template whose turns end with the tiny tokenizer's EOS (</s>), tool role included.
CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_cache: Path) -> Any:
    return load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))[1]


def call(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


# ---- parsing


def test_tagged_calls_are_read_with_their_arguments() -> None:
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert parse_tool_calls(text, ["add"]) == [ToolCall("add", {"a": 2, "b": 3})]
    two = call(1, 2) + "\n" + call(3, 4)
    assert [c.arguments for c in parse_tool_calls(two, ["add"])] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


def test_bare_json_calls_and_openai_string_arguments() -> None:
    assert parse_tool_calls(' {"name": "add", "parameters": {"a": 1, "b": 1}} ', ["add"]) == [
        ToolCall("add", {"a": 1, "b": 1})
    ]
    assert parse_tool_calls('{"name": "add", "arguments": "{\\"a\\": 5}"}', ["add"]) == [
        ToolCall("add", {"a": 5})
    ]


def test_answers_are_not_calls() -> None:
    for text in ["42", '{"answer": 42}', "{not json}", "I would call add but won't", ""]:
        assert parse_tool_calls(text, ["add"]) == []


def test_malformed_calls_are_calls_with_an_error() -> None:
    (bad_json,) = parse_tool_calls("<tool_call>{name: add}</tool_call>", ["add"])
    assert bad_json.error is not None and "not valid JSON" in bad_json.error
    (unknown,) = parse_tool_calls('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', ["add"])
    assert unknown.error == "unknown tool 'mul'; the tools are: add"
    (not_object,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', ["add"])
    assert not_object.error == "the tool call's arguments must be a JSON object"
    (unclosed,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', ["add"])
    assert unclosed == ToolCall("add", {"a": 1})  # a turn cut at its end-of-turn token still calls


# ---- tool turns


def test_plain_tool_turn_is_the_fallback_text(tokenizer: Any) -> None:
    fmt = TurnFormat(tokenizer)
    assert not fmt.uses_template and fmt.why_plain == "the tokenizer has no chat template"
    results = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "error: boom"}]
    assert fmt.text(results) == "\ntool: 5\ntool: error: boom\nassistant: "
    assert fmt.ids(results[:1]) == tokenizer("\ntool: 5\nassistant: ", add_special_tokens=False).input_ids


def test_template_tool_turn_follows_the_model_end_of_turn(tokenizer: Any) -> None:
    tokenizer.chat_template = CHATML
    try:
        fmt = TurnFormat(tokenizer)
        assert fmt.uses_template, fmt.why_plain
        # after the model's own "</s>": the template's newline, the tool message, the next turn's opening
        assert fmt.text([{"role": "tool", "content": "5"}]) == "\n<s>tool\n5</s>\n<s>assistant\n"
        assert fmt.text([{"role": "user", "content": "go on"}]) == "\n<s>user\ngo on</s>\n<s>assistant\n"
        assert not TurnFormat(tokenizer, use_template=False).uses_template
    finally:
        tokenizer.chat_template = None


def test_a_template_that_rewrites_earlier_turns_falls_back(tokenizer: Any) -> None:
    tokenizer.chat_template = (  # drops the assistant's content once a tool message follows
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<s>assistant\n</s>"
        "{% else %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    try:
        fmt = TurnFormat(tokenizer)
        assert fmt.why_plain == "the chat template rewrites earlier turns when a tool message follows"
    finally:
        tokenizer.chat_template = None


# ---- episodes over a scripted policy


class ScriptedPolicy:
    """A stand-in engine: each context gets the next text of its script (by the context's first prompt
    token), tokenized and ended with EOS; records the calls it got."""

    def __init__(self, tokenizer: Any, scripts: dict[int, list[str]], logprob: float | None = None):
        self.tokenizer, self.scripts, self.logprob = tokenizer, scripts, logprob
        self.turn: dict[int, int] = {}
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        self.calls.append((len(prompts) * n, params))
        out = []
        for p, ids in enumerate(prompts):
            for _ in range(n):
                script = self.scripts[ids[0]]
                k = self.turn.get(id(script), 0)
                self.turn[id(script)] = k + 1
                tokens = self.tokenizer(script[k], add_special_tokens=False).input_ids + [
                    self.tokenizer.eos_token_id
                ]
                finish = "eos"
                if len(tokens) > params.max_new_tokens:
                    tokens, finish = tokens[: params.max_new_tokens], "length"
                out.append(
                    Completion(
                        prompt_index=p,
                        prompt_ids=list(ids),
                        token_ids=tokens,
                        text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                        finish_reason=finish,  # type: ignore[arg-type]
                        logprobs=None if self.logprob is None else [self.logprob] * len(tokens),
                    )
                )
        return out

    def sync_weights(self, model: Any) -> None: ...

    def close(self) -> None: ...


def fake_tools(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str | None, str | None]]:
    return [(str(args["a"] + args["b"]), None) for _, args in calls]


def episodes(tokenizer: Any, policy: Any, *, turns: int = 3, tokens: int = 200) -> MultiTurnEngine:
    return tool_episodes(
        policy, tokenizer, ["add"], fake_tools, TurnFormat(tokenizer), EpisodeLimits(turns, tokens)
    )


def test_an_episode_trains_only_the_model_tokens(tokenizer: Any) -> None:
    # The tool's result holds text that looks like a tool call: it is shown to the model, never parsed,
    # never trained.
    sneaky = 'def add(a, b):\n    return str(a + b) + \' <tool_call>{"name": "add"}</tool_call>\'\n'
    prompt = tokenizer("2+3=").input_ids
    policy = ScriptedPolicy(tokenizer, {prompt[0]: [call(2, 3), "5"]}, logprob=-0.5)
    if isolation_problem() is not None:
        pytest.skip(isolation_problem() or "")
    eng = tool_episodes(
        policy,
        tokenizer,
        ["add"],
        sandbox_runner(sneaky, 2000),
        TurnFormat(tokenizer),
        EpisodeLimits(3, 200),
    )
    (c,) = eng.generate([prompt], 1, SamplingParams(max_new_tokens=64, seed=1))

    eos = tokenizer.eos_token_id
    turn1 = tokenizer(call(2, 3), add_special_tokens=False).input_ids + [eos]
    result = '5 <tool_call>{"name": "add"}</tool_call>'
    tool = tokenizer(f"\ntool: {result}\nassistant: ", add_special_tokens=False).input_ids
    turn2 = tokenizer("5", add_special_tokens=False).input_ids + [eos]
    assert c.token_ids == turn1 + tool + turn2
    assert c.token_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert c.logprobs == [-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)
    assert c.episode is not None
    assert (c.episode.turns, c.episode.tool_calls, c.episode.tool_errors) == (2, 1, 0)
    assert c.episode.ended == "answer" and c.answer == "5" and c.finish_reason == "eos"
    assert c.episode.messages[1] == {"role": "tool", "name": "add", "content": result, "error": False}
    assert c.model_tokens == len(turn1) + len(turn2)

    # The batch's response mask holds exactly those positions (prompt excluded).
    batch = to_token_batch([c], tokenizer.pad_token_id, torch.device("cpu"))
    trained = batch.response_mask[0].nonzero().flatten() + batch.offset + 1
    first = len(prompt)
    expected = list(range(first, first + len(turn1))) + list(
        range(first + len(turn1) + len(tool), first + len(c.token_ids))
    )
    assert trained.tolist() == expected


def test_episodes_end_on_answer_max_turns_or_budget(tokenizer: Any) -> None:
    a, b, d = (tokenizer(t).input_ids for t in ("1+1=", "7*8=", "the"))
    scripts = {a[0]: ["2"], b[0]: [call(1, 2), call(3, 4), call(5, 6)], d[0]: [call(1, 1), "x" * 300]}
    policy = ScriptedPolicy(tokenizer, scripts)
    out = episodes(tokenizer, policy, turns=3, tokens=300).generate(
        [a, b, d], 1, SamplingParams(max_new_tokens=64, seed=3)
    )
    ended = [(c.episode.ended, c.episode.turns, c.episode.tool_calls) for c in out if c.episode]
    assert ended == [("answer", 1, 0), ("max_turns", 3, 2), ("length", 2, 1)]
    assert [c.finish_reason for c in out] == ["eos", "eos", "length"]
    assert all(len(c.token_ids) <= 300 for c in out)
    # Later turns generate only the episodes still going, each on its own row, seeded per turn.
    (n1, p1), (n2, p2), (n3, p3) = policy.calls
    assert (n1, n2, n3) == (3, 2, 1) and p1.seed == 3 and p2.seed != 3 and p2.seed != p3.seed
    assert p2.row_ids == (1, 2) and p3.row_ids == (1,)


def test_tool_errors_go_back_to_the_model_and_episodes_go_on(tokenizer: Any) -> None:
    if isolation_problem() is not None:
        pytest.skip(isolation_problem() or "")
    source = (
        "def add(a, b):\n    if a == 0:\n        raise ValueError('no zeros')\n"
        "    if a == 1:\n        while True:\n            pass\n"
        "    if a == 2:\n        return bytearray(4 * 1024 ** 3)\n    return a + b\n"
    )
    prompts = [tokenizer(t).input_ids for t in ("1+1=", "7*8=", "the", "42")]
    bad = ['<tool_call>{"name": "add", "arguments": {"a": 0, "b": 1}}</tool_call>', call(1, 0), call(2, 0)]
    texts = [*bad, "<tool_call>{oops}</tool_call>"]
    scripts = {p[0]: [text, "done"] for p, text in zip(prompts, texts, strict=True)}
    eng = tool_episodes(
        ScriptedPolicy(tokenizer, scripts),
        tokenizer,
        ["add"],
        sandbox_runner(source, 500),
        TurnFormat(tokenizer),
        EpisodeLimits(3, 300),
    )
    out = eng.generate(prompts, 1, SamplingParams(max_new_tokens=64))
    results = [c.episode.messages[1]["content"] for c in out if c.episode]
    assert results[0] == "error: ValueError: no zeros"
    assert results[1] == "error: timed out"
    assert results[2].startswith("error: MemoryError")
    assert results[3].startswith("error: the tool call is not valid JSON")
    assert all(c.episode is not None and c.episode.tool_errors == 1 for c in out)
    assert all(c.answer == "done" and c.episode and c.episode.ended == "answer" for c in out)


def test_the_real_engine_plays_episodes_greedily(tokenizer: Any, tiny_cache: Path) -> None:
    # The random preset rarely calls a tool; what matters here: the HF engine takes row_ids and every
    # episode is one turn with all its tokens trained.
    model, tok = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    eng = episodes(tok, HFEngine(model, tok), turns=2, tokens=16)
    out = eng.generate(
        [tok("1+2=").input_ids, tok("the").input_ids], 2, SamplingParams(max_new_tokens=8, seed=5)
    )
    assert len(out) == 4 and all(
        c.episode is not None and c.token_mask == [1] * len(c.token_ids) for c in out
    )
    rows = HFEngine(model, tok).generate(
        [tok("1+2=").input_ids, tok("the").input_ids],
        1,
        SamplingParams(max_new_tokens=8, seed=5, row_ids=(2, 0)),
    )
    alone = HFEngine(model, tok).generate([tok("the").input_ids], 1, SamplingParams(max_new_tokens=8, seed=5))
    assert rows[1].token_ids == alone[0].token_ids  # row 0 of the seed, wherever it sits in the call


class BrokenFormat(TurnFormat):
    """Writes every reply but one naming 'bad', as a template that raises on some message would."""

    def ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if any("bad" in str(m["content"]) for m in messages):
            raise ValueError("this template cannot write that")
        return super().ids(messages)


def test_a_reply_the_template_cannot_write_ends_that_episode_only(tokenizer: Any) -> None:
    a, b = (tokenizer(t).input_ids for t in ("1+1=", "7*8="))
    policy = ScriptedPolicy(tokenizer, {a[0]: [call(1, 1), "2"], b[0]: [call(0, 0), "0"]})

    def tool(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str | None, str | None]]:
        return [("bad" if args["a"] == 0 else str(args["a"] + args["b"]), None) for _, args in calls]

    engine = tool_episodes(policy, tokenizer, ["add"], tool, BrokenFormat(tokenizer), EpisodeLimits(3, 300))
    fine, broken = engine.generate([a, b], 1, SamplingParams(max_new_tokens=64))
    assert fine.episode is not None and (fine.episode.ended, fine.answer) == ("answer", "2")
    assert broken.episode is not None and broken.episode.ended == "error"
    assert "could not be written in the chat template: this template cannot write that" in str(
        broken.episode.messages[-1]["content"]
    )
    assert broken.token_mask == [1] * len(broken.token_ids)  # nothing appended after the failed reply


def test_length_rewards_measure_an_episode_against_its_whole_budget(tokenizer: Any) -> None:
    from trainer.data.prompts import PromptSet
    from trainer.loops.rollouts import score
    from trainer.rewards.composite import CompositeReward, RewardComponent
    from trainer.rollout.base import Episode

    def done(budget: int | None) -> Completion:
        episode = Episode(
            messages=(), answer="x", turns=3, tool_calls=2, tool_errors=0, ended="answer", budget=budget
        )
        return Completion(0, [1], [5] * 100, "x", "eos", token_mask=[1] * 100, episode=episode)

    prompts = PromptSet(rows=[{"prompt": "p", "answer": "x"}], texts=["p"], ids=[[1]])
    reward = CompositeReward([RewardComponent("overlong_penalty", params={"cache_tokens": 16})])
    # 100 policy tokens in an episode of 300: no penalty; against one turn's 64 it would be -1
    assert score([done(300)], prompts, [0], reward, max_new_tokens=64).total == [0.0]
    assert score([done(None)], prompts, [0], reward, max_new_tokens=64).total == [-1.0]
