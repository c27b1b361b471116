"""Grader specs in OpenAI's shapes (platform.openai.com/docs/guides/graders): ``string_check``,
``text_similarity``, ``python``, ``score_model`` and ``multi``, told apart by ``type``. A grader scores one
sample of a model against one dataset item; as a reward component (``rewards: [{"grader": {...}}]``) it
is one term of the reward. Torch-free (the API validates them); the scoring is trainer/graders/.

Templates: ``input`` and ``reference`` may hold ``{{item.<field>}}`` (a field of the dataset row),
``{{sample.output_text}}`` (the model's answer) and ``{{sample.output_json.<field>}}`` (a field of the answer
read as JSON), trainer/graders/templates.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.specs.base import _Frozen
from trainer.specs.refs import REFERENCE_MARK, check_model_ref

# A judge may be any model, a scorer or a causal LM: no role to check.
JUDGE_MODEL_REFERENCE: dict[str, Any] = {REFERENCE_MARK: "model"}

SimilarityMetric = Literal[
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "cosine",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
]
MAX_SOURCE_CHARS = 256 * 1024
MAX_GRADER_DEPTH = 3


class _Grader(_Frozen):
    name: str = Field(min_length=1, max_length=128, description="The grader's name (its metric's name too).")


class _TemplatedGrader(_Grader):
    @field_validator("input", "reference", check_fields=False)
    @classmethod
    def _templates_read_known_names(cls, v: str) -> str:
        from trainer.graders.templates import check_template

        check_template(v)
        return v


class StringCheckGrader(_TemplatedGrader):
    """1.0 when ``input`` compares true with ``reference``, else 0.0: ``eq``/``ne`` compare whole strings,
    ``like`` is 'reference occurs in input', ``ilike`` the same ignoring case."""

    type: Literal["string_check"]
    input: str = Field(max_length=65_536, description='A template, e.g. "{{sample.output_text}}".')
    reference: str = Field(max_length=65_536, description='A template, e.g. "{{item.answer}}".')
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(_TemplatedGrader):
    """A similarity in [0, 1] of ``input`` to ``reference`` by ``evaluation_metric`` (docs/algorithms.md,
    "Graders", names the library and definition of each)."""

    type: Literal["text_similarity"]
    input: str = Field(max_length=65_536)
    reference: str = Field(max_length=65_536)
    evaluation_metric: SimilarityMetric
    pass_threshold: float | None = Field(
        default=None, ge=0, le=1, description="If set, the score is 1.0 at or above it and 0.0 below."
    )

    @field_validator("evaluation_metric")
    @classmethod
    def _metric_available(cls, v: str) -> str:
        from trainer.graders.similarity import UNAVAILABLE

        if v in UNAVAILABLE:
            raise ValueError(UNAVAILABLE[v])
        return v


class PythonGrader(_Grader):
    """``source`` defines ``grade(sample, item) -> float``, run in a sandbox (trainer/graders/sandbox.py): a
    separate process in its own user, network, process and mount namespaces, with only a temporary folder
    to write, no network, and CPU-time, memory, process and wall-clock limits. An error, a timeout or a
    result that is not a finite number scores 0 and counts in the grader's failures."""

    type: Literal["python"]
    source: str = Field(min_length=1, max_length=MAX_SOURCE_CHARS)
    image_tag: str | None = Field(
        default=None, description="Accepted for OpenAI compatibility; the sandbox runs this server's Python."
    )

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, v: str) -> str:
        try:
            functions = top_level_functions(v)
        except ValueError as exc:
            raise ValueError(f"source: {exc}") from None
        if "grade" not in functions:
            raise ValueError("source: defines no top-level function `grade(sample, item)`")
        refuse_without_sandbox("source: python graders")
        return v


def top_level_functions(source: str) -> dict[str, Any]:
    """The top-level ``def``s of user Python (a grader's, tools', an environment's) by name, as
    ``ast.FunctionDef`` nodes.

    Raises:
        ValueError: the source does not parse, naming the line.
    """
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"not valid Python: {exc.msg} (line {exc.lineno})") from None
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def refuse_without_sandbox(what: str) -> None:
    """Refuse user code where this host cannot isolate it (trainer/graders/sandbox.py, probed once).

    Raises:
        ValueError: ``"<what> cannot run on this server: <why>"``.
    """
    from trainer.graders.sandbox import isolation_problem

    problem = isolation_problem()
    if problem is not None:
        raise ValueError(f"{what} cannot run on this server: {problem}")


class JudgeMessage(_Frozen):
    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(
        max_length=65_536, description="A template (`{{item.*}}`, `{{sample.output_text}}`)."
    )

    @field_validator("content")
    @classmethod
    def _template(cls, v: str) -> str:
        from trainer.graders.templates import check_template

        check_template(v)
        return v


class JudgeSampling(_Frozen):
    """How a generative judge answers: greedy unless ``temperature`` > 0."""

    max_completions_tokens: int = Field(default=16, ge=1, le=1024, description="Tokens the judge may write.")
    temperature: float = Field(default=0.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    reasoning_effort: None = Field(default=None, description="Not supported: refused when set.")


class ScoreModelGrader(_Grader):
    """A model judges each sample: the ``input`` messages (templates filled) go to ``model``, and its score
    lands in ``range`` (trainer/graders/judges.py). A reward-model run (a score head) scores the rendered
    conversation with the sample as its answer, mapped into ``range`` by a sigmoid; a generative model
    answers the messages and the first number it writes, clamped to ``range``, is the score (none: the
    sample fails). Runs in training runs (the worker loads the judge); ``graders/run`` answers it with
    ``model_grader_server_error`` (the API loads no models)."""

    type: Literal["score_model"]
    model: str = Field(
        min_length=1,
        description="The judge: `run:<id>` of a reward-model or other run, a preset, or a model folder.",
        json_schema_extra=JUDGE_MODEL_REFERENCE,
    )
    input: list[JudgeMessage] = Field(min_length=1, max_length=32)
    range: tuple[float, float] = Field(default=(0.0, 1.0), description="[lowest, highest] score.")
    sampling_params: JudgeSampling = Field(default_factory=JudgeSampling)

    @field_validator("model")
    @classmethod
    def _model_ref(cls, v: str) -> str:
        check_model_ref(v)
        return v

    @model_validator(mode="after")
    def _range_ordered(self) -> ScoreModelGrader:
        low, high = self.range
        if not low < high:
            raise ValueError(f"range: [{low}, {high}] must have its lowest score below its highest")
        return self


class MultiGrader(_Grader):
    """Several graders combined by ``calculate_output``, an arithmetic expression over their names
    (``+ - * / ^``, parentheses, numbers, ``min max abs floor ceil exp sqrt log``), evaluated by a parser
    of that grammar alone (trainer/graders/arithmetic.py), never by ``eval``."""

    type: Literal["multi"]
    graders: dict[str, Grader] = Field(
        min_length=1,
        max_length=16,
        description="The graders by the names the formula uses (one grader object alone: keyed by its name).",
    )
    calculate_output: str = Field(min_length=1, max_length=4096)

    @field_validator("graders", mode="before")
    @classmethod
    def _one_grader_alone(cls, v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("type"), str) and isinstance(v.get("name"), str):
            return {v["name"]: v}  # the openai SDK's type: a single grader object
        return v

    @model_validator(mode="after")
    def _formula_reads_known_names(self) -> MultiGrader:
        from trainer.graders.arithmetic import ArithmeticError_, parse_formula

        for key in self.graders:
            if not key.isidentifier():
                raise ValueError(f"graders: the name {key!r} is not an identifier the formula can use")
        try:
            names = parse_formula(self.calculate_output).names
        except ArithmeticError_ as exc:
            raise ValueError(f"calculate_output: {exc}") from None
        unknown = sorted(names - set(self.graders))
        if unknown:
            raise ValueError(f"calculate_output: names no grader: {', '.join(unknown)}")
        if _depth(self) > MAX_GRADER_DEPTH:
            raise ValueError(f"graders: multi graders nest at most {MAX_GRADER_DEPTH} deep")
        return self


Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | MultiGrader,
    Field(discriminator="type"),
]
MultiGrader.model_rebuild()


AnyGrader = StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | MultiGrader


def _depth(grader: AnyGrader) -> int:
    if isinstance(grader, MultiGrader):
        return 1 + max(_depth(g) for g in grader.graders.values())
    return 1


def judges_of(grader: AnyGrader) -> list[str]:
    """The judge models ``grader`` names (score_model graders, in multi graders too)."""
    if isinstance(grader, ScoreModelGrader):
        return [grader.model]
    if isinstance(grader, MultiGrader):
        return [m for g in grader.graders.values() for m in judges_of(g)]
    return []


def python_sources(grader: AnyGrader) -> bool:
    """Whether ``grader`` runs user Python anywhere (a python grader, or a multi holding one)."""
    if isinstance(grader, PythonGrader):
        return True
    if isinstance(grader, MultiGrader):
        return any(python_sources(g) for g in grader.graders.values())
    return False
