"""The tokens that follow a model's tool-calling turn: its tools' results as the chat template writes them,
then the opening of the model's next turn.

A multi-turn rollout keeps the model's own tokens exactly as sampled and appends, after each turn that
called tools, the tokens of the tool messages and the next generation prompt (these are never trained:
trainer/rollout/tool_episodes.py masks them). They are found as the chat template's own text:

    delta = render([user, assistant, tool_1..tool_k], add_generation_prompt=True)[cut:]

where ``render`` is ``apply_chat_template`` over a probe exchange and ``cut`` is the end of the probe
assistant's content plus its end-of-turn token (the token the model's own turn ended with). This is what
verl's and SkyRL's multi-turn rollouts do (render the conversation, take the suffix): it holds for every
template that only appends (ChatML, Llama 3, Gemma, Qwen 2.5). A template that rewrites earlier turns when a
tool message follows (one that drops past reasoning, say), that refuses the ``tool`` role, or a tokenizer
without a template uses the plain form instead, the fallback ``render_prompt`` also uses:

    "\\ntool: <result>\\n" (one line per result) + "assistant: "
"""

from __future__ import annotations

from typing import Any

from trainer.data.chat_turns import end_of_turn_token

_PROBE = "rlrun-probe-call-5c1e"


class ToolTurnFormat:
    """Renders tool results into token ids after a model turn that ended on its end-of-turn token.

    Args:
        tokenizer: the policy's tokenizer.
        use_template: render through the tokenizer's chat template where it can (message prompts); False:
            the plain form (prompts given as plain text are not in the template's markup either).
    """

    def __init__(self, tokenizer: Any, use_template: bool = True):
        self.tokenizer = tokenizer
        self.why_plain: str | None = None
        self._template_cut: str | None = None
        if not use_template:
            self.why_plain = "the prompts are plain text"
        elif not getattr(tokenizer, "chat_template", None):
            self.why_plain = "the tokenizer has no chat template"
        else:
            self.why_plain = self._probe_template()

    @property
    def uses_template(self) -> bool:
        return self.why_plain is None

    def _render(self, results: list[str]) -> str:
        chat: list[dict[str, str]] = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": _PROBE},
        ]
        chat += [{"role": "tool", "content": r} for r in results]
        text: str = self.tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=bool(results)
        )
        return text

    def _probe_template(self) -> str | None:
        """Why the template cannot render tool turns by appending (None: it can); sets the cut text."""
        try:
            before, after = self._render([]), self._render(["rlrun-probe-result"])
        except Exception as exc:  # noqa: BLE001 - templates raise their own errors (jinja, role checks)
            return f"the chat template cannot render a tool message ({type(exc).__name__}: {exc})"
        at = before.rfind(_PROBE)
        if at < 0:
            return "the chat template does not write the assistant's content as given"
        cut = at + len(_PROBE)
        eot = end_of_turn_token(self.tokenizer) or self.tokenizer.eos_token
        rest = before[cut:]
        if eot and rest.lstrip(" ").startswith(eot):
            cut += len(rest) - len(rest.lstrip(" ")) + len(eot)
        if not after.startswith(before[:cut]) or "rlrun-probe-result" not in after[cut:]:
            return "the chat template rewrites earlier turns when a tool message follows"
        self._template_cut = before[:cut]
        return None

    def text(self, results: list[str]) -> str:
        """The text after the model's turn: ``results`` as tool messages, then the next turn's opening."""
        if not results:
            raise ValueError("no tool results to render")
        if self._template_cut is None:
            return "\n" + "".join(f"tool: {r}\n" for r in results) + "assistant: "
        return self._render(results)[len(self._template_cut) :]

    def ids(self, results: list[str]) -> list[int]:
        """``text(results)`` as token ids (no BOS or other added specials)."""
        ids: list[int] = self.tokenizer(self.text(results), add_special_tokens=False).input_ids
        return ids
