"""The tokens that follow a model's turn in a multi-turn rollout: the messages that answer it (tool results,
an environment's observation) as the chat template writes them, then the opening of the model's next turn.

A multi-turn rollout keeps the model's own tokens exactly as sampled and appends, after each turn that gets
an answer, the tokens of the answering messages and the next generation prompt (these are never trained:
trainer/rollout/episodes.py masks them). They are found as the chat template's own text:

    delta = render([user, assistant, m_1..m_k], add_generation_prompt=True)[cut:]

where ``render`` is ``apply_chat_template`` over a probe exchange and ``cut`` is the end of the probe
assistant's content plus its end-of-turn token (the token the model's own turn ended with). This is what
verl's and SkyRL's multi-turn rollouts do (render the conversation, take the suffix): it holds for every
template that only appends (ChatML, Llama 3, Gemma, Qwen 2.5). A template that rewrites earlier turns when a
tool message follows (one that drops past reasoning, say), that refuses the ``tool`` role, or a tokenizer
without a template uses the plain form instead, the fallback ``render_prompt`` also uses:

    "\\n<role>: <content>\\n" (a line per message) + "assistant: "
"""

from __future__ import annotations

from typing import Any

from trainer.data.chat_turns import end_of_turn_token

_PROBE = "rlrun-probe-call-5c1e"


class TurnFormat:
    """Renders the messages that answer a model's turn into token ids, after the turn's end-of-turn token.

    Args:
        tokenizer: the policy's tokenizer.
        use_template: render through the tokenizer's chat template where it can (message prompts); False:
            the plain form (prompts given as plain text are not in the template's markup either).
    """

    def __init__(self, tokenizer: Any, use_template: bool = True):
        self.tokenizer = tokenizer
        # the token a model's turn ends with (what closes a turn cut short before the next messages)
        self.end_of_turn: str | None = end_of_turn_token(tokenizer) or tokenizer.eos_token
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

    def _render(self, messages: list[dict[str, Any]]) -> str:
        chat: list[dict[str, Any]] = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": _PROBE},
        ]
        chat += [{"role": m["role"], "content": m["content"]} for m in messages]
        text: str = self.tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=bool(messages)
        )
        return text

    def _probe_template(self) -> str | None:
        """Why the template cannot render tool turns by appending (None: it can); sets the cut text."""
        try:
            before = self._render([])
            after = self._render([{"role": "tool", "content": "rlrun-probe-result"}])
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

    def text(self, messages: list[dict[str, Any]]) -> str:
        """The text after the model's turn: ``messages`` (each a ``role`` and ``content``) as the template
        writes them, then the next turn's opening.

        Raises:
            ValueError: no messages, or the template rewrites earlier turns when these roles follow.
        """
        if not messages:
            raise ValueError("no messages to render")
        if self._template_cut is None:
            return "\n" + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        text = self._render(messages)
        if not text.startswith(self._template_cut):
            roles = ", ".join(sorted({str(m["role"]) for m in messages}))
            raise ValueError(f"the chat template rewrites earlier turns when a {roles} message follows")
        return text[len(self._template_cut) :]

    def ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """``text(messages)`` as token ids (no BOS or other added specials)."""
        ids: list[int] = self.tokenizer(self.text(messages), add_special_tokens=False).input_ids
        return ids
