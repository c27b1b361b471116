"""``rlrun demo --real`` (issue 38): the real model found in a model root (imported once, reused), a GRPO run
with LoRA on the word problems through the API, the base model and the tuned one answering through
``/v1/chat/completions``. A short shape (1 step, 4 held-out problems, 16 new tokens, transformers
``generate``): the demo's whole path, not its numbers (bench/real_model.py measures those)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlrun.demo_real import QUESTIONS, REAL_MODEL, chat, real_part
from tests.integration.flow import embedded_server

pytestmark = [pytest.mark.slow]


def test_the_real_demo_tunes_the_imported_model_and_both_answer_through_chat(
    real_model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    roots = {"RLRUN_MODEL_ROOTS": json.dumps([str(real_model_folder.parent)])}
    with embedded_server(tmp_path, roots, inference=True) as client:
        result = real_part(
            client, 1, engine="hf", precision="fp32", prompts=2, group=2, max_new_tokens=16, held_out=4
        )
        assert result["status"] == "succeeded", result
        run = client.get(f"/v1/runs/{result['run_id']}").json()
        assert run["spec"]["model"] == REAL_MODEL and run["spec"]["adapter"]["type"] == "lora"
        with pytest.raises(RuntimeError, match=r"chat with run:nope failed \(4\d\d\)"):
            chat(client, "run:nope", QUESTIONS[0])  # a refused chat fails the demo, with the reason
    printed = capsys.readouterr().out
    assert "imported before" in printed  # found in the root: nothing imported into the server's home
    assert not (tmp_path / "models" / REAL_MODEL).exists()
    assert {result["start"], result["end"]} <= {0.0, 0.25, 0.5, 0.75, 1.0}  # 4 problems, greedy
    assert len(result["before"]) == len(result["after"]) == len(QUESTIONS) + 1
    for answer in result["before"] + result["after"]:  # a reply in words, not an error from the route
        assert answer and not answer.startswith("[") and any(c.isalpha() for c in answer), answer
    assert "France" in result["before"][0] or "Paris" in result["before"][0]
