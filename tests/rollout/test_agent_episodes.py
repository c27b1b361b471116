"""Bring your own agent: an agent's chat completion calls become one training sample whose tokens are those
the endpoint generated from and returned, with only the policy's own tokens trained (checked against
token sequences built by hand), over the board directly and over the gateway with the official `openai`
SDK; limits, rewrites and timeouts."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from trainer.completion_logps import reply_logprobs
from trainer.gateway_server import TOKEN_HEADER
from trainer.loops.rl_common import forward_logps, to_token_batch
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.rollout.agent_chat import AgentRequestError
from trainer.rollout.agent_episodes import AgentBoard, AgentEpisodes, BoardClosed
from trainer.rollout.agent_gateway import AgentGateway
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.episodes import TaggedPrompt
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.turn_format import TurnFormat

# A ChatML-like template whose turns end with the tiny tokenizer's EOS (</s>), tool role included.
CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_cache: Path) -> tuple[Any, Any]:
    model, tokenizer = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    tokenizer.chat_template = CHATML
    return model, tokenizer


@pytest.fixture
def tokenizer(model_and_tokenizer: tuple[Any, Any]) -> Any:
    return model_and_tokenizer[1]


class Scripted:
    """A stand-in engine: the k-th call of the test gets ``replies[k]`` tokenized and ended with EOS;
    records each context it was given."""

    def __init__(self, tokenizer: Any, replies: list[str]):
        self.tokenizer, self.replies, self.contexts = tokenizer, list(replies), []  # type: ignore[var-annotated]

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        out = []
        for p in prompts:
            self.contexts.append(list(p))
            text = self.replies.pop(0)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
            out.append(
                Completion(prompt_index=0, prompt_ids=list(p), token_ids=ids, text=text, finish_reason="eos")
            )
        return out

    def sync_weights(self, model: Any) -> None: ...

    def close(self) -> None: ...


def episodes_engine(engine: Any, tokenizer: Any, board: AgentBoard, **kw: Any) -> AgentEpisodes:
    args = {"timeout": 30.0, "max_calls": 4, "budget": 400, "max_prompt_tokens": 200} | kw
    return AgentEpisodes(engine, tokenizer, board, TurnFormat(tokenizer), **args)


def play_in_background(
    engine: AgentEpisodes, rows: list[dict[str, Any]], n: int = 1, params: SamplingParams | None = None
) -> tuple[threading.Thread, list[Completion]]:
    """The rollout (``engine.generate``) on a thread of its own, as the training loop would run it."""
    out: list[Completion] = []
    prompts = [TaggedPrompt(engine.tokenizer(r["prompt"]).input_ids, r) for r in rows]
    thread = threading.Thread(
        target=lambda: out.extend(engine.generate(prompts, n, params or SamplingParams(max_new_tokens=48))),
        daemon=True,
    )
    thread.start()
    return thread, out


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def test_calls_extending_one_conversation_are_one_sample_with_only_the_policys_tokens_trained(
    tokenizer: Any,
) -> None:
    board = AgentBoard()
    engine = episodes_engine(Scripted(tokenizer, [CALL, "The sum is 5."]), tokenizer, board)
    thread, out = play_in_background(engine, [{"prompt": "Add 2 and 3.", "answer": "5"}])
    offer = board.next_episode(wait=10)
    assert offer is not None and offer["row"] == {"prompt": "Add 2 and 3.", "answer": "5"}
    user = {"role": "user", "content": "Add 2 and 3."}
    first = board.chat(offer["id"], {"messages": [user], "tools": TOOLS})
    message = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"a": 2, "b": 3}]
    # A tool result that looks like a tool call is the agent's text: never parsed, never trained.
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5 " + CALL}
    second = board.chat(offer["id"], {"messages": [user, message, result], "tools": TOOLS})
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "The sum is 5."}
    board.report(offer["id"], 1.0)
    thread.join(10)
    (c,) = out
    # By hand: the template's prompt, the first reply's tokens, the tool turn as the template writes it
    # after the reply's </s>, then the second reply's tokens.
    eos = tokenizer.eos_token_id
    prompt = tokenizer("<s>user\nAdd 2 and 3.</s>\n<s>assistant\n").input_ids
    reply1, reply2 = ids(tokenizer, CALL) + [eos], ids(tokenizer, "The sum is 5.") + [eos]
    delta = ids(tokenizer, "\n<s>tool\n5 " + CALL + "</s>\n<s>assistant\n")
    assert c.prompt_ids == prompt
    assert c.token_ids == reply1 + delta + reply2
    assert c.token_mask == [1] * len(reply1) + [0] * len(delta) + [1] * len(reply2)
    # What the endpoint said it generated from and returned is exactly the sample's tokens.
    assert first["prompt_token_ids"] == prompt and first["choices"][0]["token_ids"] == reply1
    assert second["prompt_token_ids"] == prompt + reply1 + delta
    assert second["choices"][0]["token_ids"] == reply2
    assert c.episode is not None and c.episode.env_return == 1.0 and c.episode.turns == 2
    assert c.episode.tool_calls == 1 and c.episode.ended == "answer" and c.answer == "The sum is 5."
    assert [m["role"] for m in c.episode.messages] == ["user", "assistant", "tool", "assistant"]
    batch = to_token_batch([c], pad_id=0, device=torch.device("cpu"))
    trained = batch.targets[0][batch.response_mask[0] > 0].tolist()
    assert trained == reply1 + reply2


def test_a_rewritten_history_starts_the_sample_over(tokenizer: Any) -> None:
    board = AgentBoard()
    engine = episodes_engine(Scripted(tokenizer, ["one", "two"]), tokenizer, board)
    thread, out = play_in_background(engine, [{"prompt": "p"}])
    offer = board.next_episode(wait=10)
    assert offer is not None
    board.chat(offer["id"], {"messages": [{"role": "user", "content": "first try"}]})
    board.chat(
        offer["id"], {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "again"}]}
    )
    board.report(offer["id"], 0.5)
    thread.join(10)
    (c,) = out
    assert c.prompt_ids == tokenizer("<s>system\nS</s>\n<s>user\nagain</s>\n<s>assistant\n").input_ids
    assert c.token_ids == ids(tokenizer, "two") + [tokenizer.eos_token_id] and set(c.token_mask or []) == {1}


def test_limits_and_bad_requests_are_refused_with_the_field_named(tokenizer: Any) -> None:
    board = AgentBoard()
    engine = episodes_engine(
        Scripted(tokenizer, ["a", "b"]), tokenizer, board, max_calls=1, max_prompt_tokens=20
    )
    thread, out = play_in_background(engine, [{"prompt": "p"}])
    offer = board.next_episode(wait=10)
    assert offer is not None
    eid = offer["id"]
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "word " * 40}]}, "messages"),  # over max_prompt_tokens
    ]:
        with pytest.raises(AgentRequestError) as caught:
            board.chat(eid, body)
        assert caught.value.param == param and caught.value.status == 400, body
    first = [{"role": "user", "content": "hi"}]
    reply = board.chat(eid, {"messages": first})["choices"][0]["message"]
    with pytest.raises(AgentRequestError, match="call limit") as caught:
        board.chat(eid, {"messages": [*first, reply, {"role": "user", "content": "more"}]})
    assert caught.value.code == "episode_limit"
    with pytest.raises(AgentRequestError) as unknown:
        board.chat("0" * 32, {"messages": first})
    assert unknown.value.status == 404
    with pytest.raises(AgentRequestError, match="reward must be a number"):
        board.report(eid, float("nan"))
    board.report(eid, 1.0)
    with pytest.raises(AgentRequestError, match="has its reward already"):
        board.report(eid, 1.0)
    thread.join(10)
    (c,) = out
    assert c.episode is not None and c.episode.ended == "max_turns" and c.episode.env_return == 1.0
    with pytest.raises(AgentRequestError, match="is closed") as closed:  # after the rollout: 409
        board.chat(eid, {"messages": first})
    assert closed.value.status == 409


def test_episodes_that_never_report_time_out_and_train_nothing(tokenizer: Any) -> None:
    board = AgentBoard()
    engine = episodes_engine(Scripted(tokenizer, ["x"]), tokenizer, board, timeout=1.0)
    thread, out = play_in_background(engine, [{"prompt": "p"}], n=2)
    taken = board.next_episode(wait=5)
    assert taken is not None
    board.chat(taken["id"], {"messages": [{"role": "user", "content": "hi"}]})  # then never reports
    thread.join(10)
    assert [c.episode.ended for c in out if c.episode is not None] == ["timeout", "timeout"]
    assert all(set(c.token_mask or []) == {0} for c in out)
    assert [c.episode.turns for c in out if c.episode is not None] == [1, 0]  # what it did is shown
    with pytest.raises(AgentRequestError, match="timed out"):
        board.report(taken["id"], 1.0)
    board.close()
    with pytest.raises(BoardClosed):
        board.next_episode(wait=0)


def test_an_openai_sdk_agent_over_the_gateway_trains_on_what_the_endpoint_returned(
    model_and_tokenizer: tuple[Any, Any],
) -> None:
    """The real transformers engine and the official SDK: concurrent episodes are served, each call's
    returned token ids are its sample's tokens, and the log-probs it returned are those the trainer
    computes for the same tokens."""
    model, tokenizer = model_and_tokenizer
    board = AgentBoard()
    gateway = AgentGateway(board, host="127.0.0.1")
    agents: list[threading.Thread] = []
    try:
        engine = episodes_engine(
            HFEngine(model, tokenizer),
            tokenizer,
            board,
            logprobs_of=lambda c, t, temp: reply_logprobs(model, c, t, temp),
        )
        params = SamplingParams(max_new_tokens=6, temperature=0.7, seed=3)
        rows = [{"prompt": f"question {k}"} for k in range(2)]
        thread, out = play_in_background(engine, rows, n=2, params=params)
        headers = {TOKEN_HEADER: gateway.token}
        seen: dict[str, list[dict[str, Any]]] = {}

        def agent() -> None:
            while True:
                got = httpx.get(f"{gateway.url}/episodes/next", params={"wait": 2}, headers=headers)
                if got.status_code != 200:
                    return
                episode = got.json()
                client = openai.OpenAI(
                    base_url=f"{gateway.url}/episodes/{episode['id']}", api_key="x", default_headers=headers
                )
                messages: list[Any] = [{"role": "user", "content": episode["row"]["prompt"]}]
                answers = seen.setdefault(episode["id"], [])
                for _ in range(2):
                    r = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
                    answers.append(r.model_dump())
                    messages += [
                        r.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": "and?"},
                    ]
                httpx.post(
                    f"{gateway.url}/episodes/{episode['id']}/reward", json={"reward": 1}, headers=headers
                )

        agents += [threading.Thread(target=agent, daemon=True) for _ in range(2)]
        for a in agents:
            a.start()
        thread.join(60)
        assert len(out) == 4 and all(c.episode is not None and c.episode.ended == "answer" for c in out)
        for c in out:
            first, second = next(  # the episode whose first reply opens this sample
                (a, b)
                for a, b in seen.values()
                if c.token_ids[: len(a["choices"][0]["token_ids"])] == a["choices"][0]["token_ids"]
            )
            assert first["prompt_token_ids"] == c.prompt_ids
            assert (
                second["prompt_token_ids"]
                == c.prompt_ids + c.token_ids[: len(second["prompt_token_ids"]) - len(c.prompt_ids)]
            )
            assert (
                c.token_ids[len(second["prompt_token_ids"]) - len(c.prompt_ids) :]
                == second["choices"][0]["token_ids"]
            )
            # the returned log-probs are the trainer's for the same tokens at the same temperature
            returned = [t["logprob"] for t in first["choices"][0]["logprobs"]["content"]]
            batch = to_token_batch([c], pad_id=0, device=torch.device("cpu"))
            trainer = forward_logps(model, batch, temperature=0.7)[1][0][: len(returned)].tolist()
            assert returned == pytest.approx(trainer, abs=1e-4)
    finally:
        board.close()  # the agents' next poll answers 410 and they stop
        for a in agents:
            a.join(10)
        gateway.close()


def test_the_gateway_refuses_calls_without_its_token(tokenizer: Any) -> None:
    gateway = AgentGateway(AgentBoard(), host="127.0.0.1")
    try:
        assert httpx.get(f"{gateway.url}/episodes/next").status_code == 401
        wrong = httpx.get(f"{gateway.url}/episodes/next", headers={TOKEN_HEADER: "nope"})
        assert wrong.status_code == 401
        none = httpx.get(
            f"{gateway.url}/episodes/next", params={"wait": 0}, headers={TOKEN_HEADER: gateway.token}
        )
        assert none.status_code == 204
    finally:
        gateway.close()
    board = AgentBoard()
    board.close()
    gateway = AgentGateway(board, host="127.0.0.1")
    try:
        gone = httpx.get(f"{gateway.url}/episodes/next", headers={TOKEN_HEADER: gateway.token})
        assert gone.status_code == 410
    finally:
        gateway.close()


class SlowOnce(Scripted):
    """``Scripted`` whose first reply takes a second (longer than its caller waits)."""

    slow = True

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        if self.slow:
            self.slow = False
            time.sleep(1.0)
        return super().generate(prompts, n, params)


def test_a_failed_call_leaves_the_episode_as_it_was_and_a_repeated_call_gets_the_same_answer(
    tokenizer: Any,
) -> None:
    board = AgentBoard()
    engine = episodes_engine(SlowOnce(tokenizer, ["lost", "first", "second"]), tokenizer, board)
    thread, out = play_in_background(engine, [{"prompt": "p"}])
    offer = board.next_episode(wait=10)
    assert offer is not None
    eid, user = offer["id"], {"role": "user", "content": "hi"}
    with pytest.raises(AgentRequestError, match="not served in time") as failed:
        board.chat(eid, {"messages": [user]}, wait=0.2)  # the caller gives up; its reply is not kept
    assert failed.value.status == 409
    time.sleep(1.2)
    first = board.chat(eid, {"messages": [user]})  # not a rewrite: the failed call left nothing behind
    assert board.chat(eid, {"messages": [user]}) == first  # a retry of a lost answer: the same answer
    reply = first["choices"][0]["message"]
    assert reply["content"] == "first"  # the reply its caller never got is not in the episode
    second = board.chat(eid, {"messages": [user, reply, {"role": "user", "content": "more"}]})
    assert second["choices"][0]["message"]["content"] == "second"
    board.report(eid, 1.0)
    thread.join(10)
    (c,) = out
    conv_calls = c.episode.turns if c.episode is not None else 0
    assert (
        conv_calls == 2
        and c.token_ids[: len(first["choices"][0]["token_ids"])] == first["choices"][0]["token_ids"]
    )
    assert engine.board.retired[eid] == "is closed: its reward is in"


def test_a_reward_waits_for_the_call_in_progress(tokenizer: Any) -> None:
    board = AgentBoard()
    engine = episodes_engine(Scripted(tokenizer, ["x"]), tokenizer, board)
    thread, out = play_in_background(engine, [{"prompt": "p"}])
    offer = board.next_episode(wait=10)
    assert offer is not None
    with board.cond:  # a call is being served
        board.live[offer["id"]].busy = True
    with pytest.raises(AgentRequestError, match="call in progress"):
        board.report(offer["id"], 1.0)
    with board.cond:
        board.live[offer["id"]].busy = False
    board.report(offer["id"], 1.0)
    thread.join(10)
    assert out[0].episode is not None and out[0].episode.ended == "error"  # a reward without any call
