"""Where a chat template ends an assistant turn.

Chat models stop by emitting the token their template closes an assistant message with: ``<|im_end|>``
(ChatML: SmolLM2, Qwen), ``<|eot_id|>`` (Llama 3), ``<end_of_turn>`` (Gemma). Some tokenizers name another
token as EOS (Gemma's ``<eos>``, a base model's ``<|endoftext|>``): a completion that ends in that EOS
teaches the model to end its turns with a token its template never writes, and generation that stops
only at it runs past the turn. ``rlrun models import`` reads the template's end-of-turn token here and
makes it the imported tokenizer's EOS, so every path (SFT and preference targets, rollouts, chat) ends a
turn the way the template does.
"""

from __future__ import annotations

from typing import Any

_PROBE = "rlrun-probe-answer-7f3a"


def end_of_turn_token(tokenizer: Any) -> str | None:
    """The special token right after an assistant message in the tokenizer's chat template, or None when
    there is no template, it cannot render a user/assistant exchange, or plain text follows the answer."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text: str = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001 - templates raise their own errors (jinja, role checks)
        return None
    at = text.rfind(_PROBE)
    if at < 0:
        return None
    after = text[at + len(_PROBE) :]
    special = sorted(set(tokenizer.all_special_tokens) | _added_special(tokenizer), key=len, reverse=True)
    stripped = after.lstrip(" ")
    return next((token for token in special if token and stripped.startswith(token)), None)


def _added_special(tokenizer: Any) -> set[str]:
    """Tokens added as special (``<end_of_turn>`` is one in Gemma's vocabulary, not a named special)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {str(t) for t in decoder.values() if getattr(t, "special", False)}
