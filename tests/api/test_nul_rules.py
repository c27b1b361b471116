"""The two NUL rules of ``trainer.specs`` (torch-free, so the API and the worker share them): ``refuse_nul``
refuses what a user sends, naming where; ``without_nul`` replaces it in what a run makes."""

from __future__ import annotations

import pytest

from trainer.specs import refuse_nul, without_nul


def test_without_nul_replaces_every_nul_in_keys_items_and_nested_values() -> None:
    value = {"parsed\x00": ["a\x00", {"k": "\x00b"}, 3, None], "t": ("x\x00", 1.5), "ok": "plain"}
    assert without_nul(value) == {
        "parsed\ufffd": ["a\ufffd", {"k": "\ufffdb"}, 3, None],
        "t": ["x\ufffd", 1.5],
        "ok": "plain",
    }
    assert without_nul("1+1=\x00") == "1+1=\ufffd"
    assert without_nul(7) == 7


def test_refuse_nul_names_the_field_and_passes_clean_values_unchanged() -> None:
    clean = {"a": ["x", {"b": "y"}]}
    assert refuse_nul(clean, "params") is clean
    with pytest.raises(ValueError, match=r"params\.a\[1\]\.b contains a NUL character"):
        refuse_nul({"a": ["x", {"b": "y\x00"}]}, "params")
    with pytest.raises(ValueError, match=r"^params contains a NUL character"):
        refuse_nul({"k\x00": 1}, "params")  # a key: named by the object that holds it
