"""POST /v1/fine_tuning/alpha/graders/run and /validate, as OpenAI documents them: check a grader, and
score one model sample against one item with it (trainer/graders/; python graders in the sandbox)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api.deps import ProjectDep
from api.errors import OpenAIErrorBody
from trainer.graders.grade import grade_batch
from trainer.specs.graders import Grader, MultiGrader, PythonGrader

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["openai"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorBody} for code in (400, 401, 422)}


class GraderValidate(BaseModel):
    grader: Grader


class GraderValidateResponse(BaseModel):
    grader: Grader


class GraderRun(BaseModel):
    grader: Grader
    model_sample: str = Field(max_length=1_048_576, description="The sample: `sample.output_text`.")
    item: dict[str, Any] = Field(default_factory=dict, description="The dataset item: `item.*`.")


class GraderErrors(BaseModel):
    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderErrors
    execution_time: float = Field(description="Seconds the grading took.")
    scores: dict[str, Any] = Field(description="A multi grader's sub-grader scores by name.")
    token_usage: int | None = None
    sampled_model_name: str | None = None


class GraderRunResponse(BaseModel):
    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, Any]
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)


@router.post("/validate", response_model=GraderValidateResponse, responses=_ERRORS)
def validate_grader(body: GraderValidate, _project: ProjectDep) -> GraderValidateResponse:
    """Check a grader (templates, formula, metric, python source); 400 naming the field otherwise."""
    return GraderValidateResponse(grader=body.grader)


def _errors(grader: Any, failed: bool, error: str | None) -> GraderErrors:
    if not failed:
        return GraderErrors()
    text = error or ""
    if isinstance(grader, PythonGrader) or (isinstance(grader, MultiGrader) and "grade" in text):
        server = text.startswith("the sandbox")
        return GraderErrors(
            python_grader_runtime_error=not server,
            python_grader_runtime_error_details=None if server else text,
            python_grader_server_error=server,
            python_grader_server_error_type=text if server else None,
        )
    if text.startswith("score_model graders run in training runs"):
        return GraderErrors(model_grader_server_error=True, model_grader_server_error_details=text)
    if text.startswith("calculate_output"):
        return GraderErrors(formula_parse_error=True, other_error=True)
    if "{{" in text:
        return GraderErrors(invalid_variable_error=True)
    return GraderErrors(other_error=True)


@router.post("/run", response_model=GraderRunResponse, responses=_ERRORS)
def run_grader(body: GraderRun, _project: ProjectDep) -> GraderRunResponse:
    """Score ``model_sample`` against ``item`` with ``grader``: ``reward`` (0 where grading failed, with
    ``metadata.errors`` saying why) and, for a multi grader, each sub-grader's score."""
    start = time.perf_counter()
    graded = grade_batch(body.grader, [body.model_sample], [body.item])
    failed = graded.failed[0]
    sub = {name: values[0] for name, values in graded.sub_scores.items()}
    return GraderRunResponse(
        reward=graded.scores[0],
        metadata=GraderRunMetadata(
            name=body.grader.name,
            type=body.grader.type,
            errors=_errors(body.grader, failed, graded.first_error),
            execution_time=time.perf_counter() - start,
            scores=sub,
        ),
        sub_rewards=sub,
    )
