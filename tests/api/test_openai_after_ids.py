"""The OpenAI-shaped job lists' ``after`` ids (``ftevent-N``, ``ftckpt-<run>-N``) read as one-column keyset
keys by one helper: the first page, a key, and a refusal that names ``after``."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from api.errors import ApiError
from api.openai_mapping import checkpoint_id, event_id, parse_checkpoint_step, parse_event_id
from api.services.openai_compat import _id_key


def test_an_id_gives_its_key_and_none_the_first_page() -> None:
    assert _id_key(None, parse_event_id, "an event id (ftevent-...)") is None
    assert _id_key(event_id(42), parse_event_id, "an event id (ftevent-...)") == (42,)
    step_id = checkpoint_id(uuid.uuid4(), 7)
    assert _id_key(step_id, parse_checkpoint_step, "a checkpoint id (ftckpt-...)") == (7,)


@pytest.mark.parametrize(
    ("after", "parse", "what"),
    [
        ("ftckpt-ab-3", parse_event_id, "an event id (ftevent-...)"),
        ("ftevent-x", parse_event_id, "an event id (ftevent-...)"),
        ("ftevent-3", parse_checkpoint_step, "a checkpoint id (ftckpt-...)"),
    ],
)
def test_another_string_is_refused_naming_after(
    after: str, parse: Callable[[str], int | None], what: str
) -> None:
    with pytest.raises(ApiError) as caught:
        _id_key(after, parse, what)
    assert caught.value.field == "after"
    assert caught.value.status == 400
    assert caught.value.message == f"after: {after!r} is not {what}"
