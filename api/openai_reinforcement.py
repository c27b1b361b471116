"""OpenAI reinforcement fine-tuning jobs as rlrun `grpo` runs (docs/openai.md, "Reinforcement").

``method.reinforcement.grader`` becomes the run's one reward (``rewards: [{"grader": ...}]``); the file is
a ``prompts`` dataset (RFT lines: chat ``messages`` ending in a user turn, the other fields the item). The
hyperparameters map as:

* ``batch_size`` -> ``prompts_per_step`` (``auto``: min(8, rows));
* ``n_epochs`` -> ``max_steps = ceil(n_epochs * rows / batch_size)`` (``auto``: 1 epoch);
* ``compute_multiplier`` -> ``samples_per_prompt = max(2, round(4 * multiplier))`` (``auto``: 1, i.e. 4);
* ``learning_rate_multiplier`` -> times GRPO's default learning rate for the model's size;
* ``eval_interval`` -> ``eval_every`` (``auto``: 10), ``eval_samples`` -> ``eval_max_rows`` (``auto``: 64):
  greedy answers to the validation file's prompts, graded (``eval/accuracy``);
* ``reasoning_effort`` other than ``default`` is refused: it tunes OpenAI's reasoning models, and rlrun
  trains the given model as it is.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from api.errors import ApiError
from api.models import Dataset
from api.schemas_openai import (
    FineTuningJobCreate,
    Method,
    ReinforcementMethod,
    ReinforcementMethodHyperparameters,
    hyperparameter_number,
)
from trainer.lr_defaults import default_learning_rate, preset_params_of
from trainer.specs import GroupRlSpec

AUTO_RL_EPOCHS = 1
AUTO_BATCH = 8
BASE_SAMPLES = 4
AUTO_EVAL_INTERVAL = 10
AUTO_EVAL_SAMPLES = 64


def samples_per_prompt(compute_multiplier: float) -> int:
    return max(2, round(BASE_SAMPLES * compute_multiplier))


def plan_reinforcement(
    body: FineTuningJobCreate,
    method: ReinforcementMethod,
    *,
    training: Dataset,
    validation: Dataset | None,
    seed: int,
    n_params: int | None,
) -> tuple[GroupRlSpec, Method]:
    """The grpo spec and the resolved method of a reinforcement job (ApiError naming the parameter)."""
    given = method.hyperparameters or ReinforcementMethodHyperparameters()
    param = "method.reinforcement.hyperparameters"
    if given.reasoning_effort not in (None, "default"):
        raise ApiError(
            f"{param}.reasoning_effort: '{given.reasoning_effort}' tunes OpenAI's reasoning models; rlrun "
            "trains the given model as it is (leave it out, or 'default')",
            field=f"{param}.reasoning_effort",
        )
    rows = training.row_count
    n_epochs = int(hyperparameter_number(given.n_epochs, AUTO_RL_EPOCHS))
    batch = int(hyperparameter_number(given.batch_size, min(AUTO_BATCH, rows)))
    multiplier = hyperparameter_number(given.learning_rate_multiplier, 1.0)
    compute = hyperparameter_number(given.compute_multiplier, 1.0)
    interval = int(hyperparameter_number(given.eval_interval, AUTO_EVAL_INTERVAL))
    eval_samples = int(hyperparameter_number(given.eval_samples, AUTO_EVAL_SAMPLES))
    if n_params is None:
        n_params = preset_params_of(body.model)
    hp: dict[str, Any] = {
        "max_steps": -(-n_epochs * rows // batch),
        "prompts_per_step": batch,
        "samples_per_prompt": samples_per_prompt(compute),
        "learning_rate": multiplier * default_learning_rate("grpo", n_params),
        "eval_every": interval,
        "eval_max_rows": eval_samples,
        "seed": seed,
    }
    names = {
        "max_steps": "n_epochs",
        "prompts_per_step": "batch_size",
        "samples_per_prompt": "compute_multiplier",
        "learning_rate": "learning_rate_multiplier",
        "eval_every": "eval_interval",
        "eval_max_rows": "eval_samples",
    }
    try:
        spec = GroupRlSpec.model_validate(
            {
                "algorithm": "grpo",
                "model": body.model,
                "dataset_id": training.id,
                "validation_dataset_id": validation.id if validation is not None else None,
                "name": body.suffix,
                "rewards": [{"grader": method.grader.model_dump()}],
                "hyperparameters": hp,
            }
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        if loc[:1] == ["hyperparameters"] and len(loc) > 1:
            where = f"{param}.{names.get(loc[1], loc[1])}"
        elif loc[:1] == ["rewards"]:
            where = "method.reinforcement.grader"
        else:
            where = {"dataset_id": "training_file", "validation_dataset_id": "validation_file"}.get(
                loc[0] if loc else "", ".".join(loc) or param
            )
        raise ApiError(f"{where}: {first['msg']}", field=where) from None
    resolved = ReinforcementMethodHyperparameters(
        n_epochs=n_epochs,
        batch_size=batch,
        learning_rate_multiplier=multiplier,
        compute_multiplier=compute,
        eval_interval=interval,
        eval_samples=eval_samples,
        reasoning_effort=given.reasoning_effort,
    )
    return spec, Method(
        type="reinforcement",
        reinforcement=ReinforcementMethod(grader=method.grader, hyperparameters=resolved),
    )
