"""An agent program for an rlrun agent run (docs/runs.md, "Bring your own agent"), written with nothing but
the official `openai` SDK and `httpx`: it plays the run's episodes until the run is over.

Each episode: the prompt as a user message, up to ``--turns`` chat completion calls with a calculator tool
(`add`; the policy's tool calls are run here and their results sent back as tool messages), then a reward
of 1 when the last reply contains the row's `answer`, else 0.

    python examples/openai_agent.py --url http://localhost:8000 --run <RUN> [--key <API key>]

Several copies may run at once (each takes the episodes it asks for first).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx
import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


def run_tool(call: Any) -> str:
    """The result of one of the policy's tool calls, or why it failed (the policy sees either)."""
    try:
        args = json.loads(call.function.arguments or "{}")
        if call.function.name != "add":
            return f"error: unknown tool {call.function.name!r}"
        return str(args["a"] + args["b"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def play(episode: dict[str, Any], key: str, turns: int) -> float | None:
    """One episode: the conversation, with tools, then its reward (None: the episode timed out)."""
    client = openai.OpenAI(base_url=episode["base_url"], api_key=key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": str(episode["row"]["prompt"])}]
    text = ""
    for _ in range(turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError:  # the episode's call limit or token budget: it ends here
            break
        except openai.ConflictError:  # the episode timed out (the run moved on): nothing to report
            return None
        message = reply.choices[0].message
        messages.append(message)
        text = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    answer = str(episode["row"].get("answer", ""))
    return float(bool(answer) and answer in text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the rlrun server")
    parser.add_argument("--run", required=True, help="the agent run's id")
    parser.add_argument("--key", default="unused", help="an rlrun API key (any text where auth is off)")
    parser.add_argument("--turns", type=int, default=3, help="chat completion calls per episode, at most")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.key}"}
    played = 0
    with httpx.Client(base_url=args.url, headers=headers, timeout=90) as http:
        while True:
            got = http.get(f"/v1/runs/{args.run}/agent/episodes/next", params={"wait": 20})
            if got.status_code == 410:  # the run is over
                break
            waiting = got.status_code == 409 and got.json()["error"]["code"] == "agent_not_ready"
            if waiting or got.status_code in (
                502,
                503,
            ):  # not started yet, or its worker is busy or between attempts
                time.sleep(1)
                continue
            if got.status_code == 204:  # the run is training between rollouts
                continue
            got.raise_for_status()
            episode = got.json()
            reward = play(episode, args.key, args.turns)
            if reward is None:
                continue
            posted = http.post(episode["reward_url"], json={"reward": reward})
            if posted.status_code != 409:  # 409: it timed out meanwhile
                posted.raise_for_status()
                played += 1
    print(f"played {played} episodes")  # noqa: T201 - the script's one line of output


if __name__ == "__main__":
    main()
