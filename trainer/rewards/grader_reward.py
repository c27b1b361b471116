"""A grader (trainer/specs/graders.py) as a reward component: the batch's completions graded against their
dataset rows' items (trainer/graders/grade.py), as ``CompositeReward`` wants a batch component."""

from __future__ import annotations

from collections.abc import Sequence

from trainer.graders.grade import AnyGrader, JudgeScorer, grade_batch, item_of
from trainer.graders.sandbox import DEFAULT_LIMITS, Limits
from trainer.rewards.verifiers import Sample


class GraderReward:
    def __init__(
        self, grader: AnyGrader, limits: Limits = DEFAULT_LIMITS, judges: JudgeScorer | None = None
    ) -> None:
        self.grader, self.limits, self.judges = grader, limits, judges

    def __call__(self, samples: Sequence[Sample]) -> tuple[list[float], list[bool], str | None]:
        graded = grade_batch(
            self.grader,
            [s.completion for s in samples],
            [item_of(s.row) for s in samples],
            self.limits,
            self.judges,
        )
        return graded.scores, graded.failed, graded.first_error
