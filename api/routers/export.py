"""GET /v1/runs/{id}/export: a succeeded run's model as a tar of a Hugging Face folder, with its length.

``format=hf`` streams a full fine-tuning run's final model folder (``from_pretrained`` loads it);
``format=adapter`` streams an adapter run's adapter folder (peft's ``PeftModel.from_pretrained`` over the
base). The resume-only files of a checkpoint (the trainer state, a pickle with the optimizer; a sharded
run's optimizer shards; and the retention metrics) are left out. The API only streams files it already
has: merging an adapter into its base needs torch, so ``format=hf`` of an adapter run streams the folder
of a succeeded ``merge`` run of it (a worker job, trainer/loops/merge.py), and answers 409
``merge_required`` until there is one.
Either carries a model card as its ``README.md`` (api/model_card.py): what produced it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from api.deps import RunDep, SessionDep
from api.errors import ApiError, InvalidTransition
from api.models import Run
from api.services import runs as service
from api.tar_stream import tar_response
from rlrun.schemas import ErrorBody
from trainer.adapter_folders import is_adapter_folder
from trainer.specs import MODELLESS_ALGORITHMS

router = APIRouter(prefix="/v1/runs/{run_id}/export", tags=["runs"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 404, 409, 422)}
# trainer/checkpoints.py's STATE_FILE, METRICS_FILE and OPTIMIZER_SHARDS (a folder) (not imported: that
# module imports torch).
RESUME_ONLY = frozenset({"trainer_state.pt", "metrics.json", "optimizer"})


class ExportRefused(ApiError):
    status = 409
    code = "export_unavailable"


class MergeRequired(ExportRefused):
    code = "merge_required"


def merge_of(session: SessionDep, run: Run) -> Run:
    """The newest succeeded merge run of ``run``'s adapter (its folder on disk), or 409 ``merge_required``
    saying how to make one (or which merge is on its way)."""
    merge, pending = service.merge_state(session=session, run=run)
    if merge is not None:
        return merge
    if pending is not None:
        raise MergeRequired(
            f"run {run.id}'s adapter is being merged into its base by run {pending.id} ({pending.status}): "
            "export format=hf when that run has succeeded",
            field="format",
        )
    raise MergeRequired(
        f"run {run.id} trained a LoRA adapter: merge it into its base first with a merge run (POST /v1/runs "
        f'{{"algorithm": "merge", "model": "run:{run.id}"}}; `rlrun runs download --format hf` does it for '
        "you), or export format=adapter and load it with peft",
        field="format",
    )


@router.get(
    "",
    responses={200: {"content": {"application/x-tar": {}}, "description": "tar archive"}, **_ERRORS},
    response_class=StreamingResponse,
)
def export_model(
    run: RunDep,
    session: SessionDep,
    format: Annotated[
        Literal["hf", "adapter"],
        Query(description="`hf`: a Hugging Face model folder; `adapter`: an adapter run's LoRA adapter."),
    ] = "hf",
) -> StreamingResponse:
    """The run's final model as a tar (`Content-Length` set, so clients show progress)."""
    if run.algorithm in MODELLESS_ALGORITHMS:
        raise ExportRefused(f"run {run.id} is an {run.algorithm} run: it trains nothing and makes no model")
    if run.status != "succeeded" or not run.output_path:
        raise InvalidTransition(f"run {run.id} is {run.status}: only a succeeded run's model can be exported")
    folder = Path(run.output_path)
    if not folder.is_dir():
        raise ExportRefused(f"run {run.id}'s model files are gone from the server")
    is_adapter = is_adapter_folder(folder)
    if format == "adapter" and not is_adapter:
        raise ExportRefused(
            f"run {run.id} trained the whole model (no adapter): export it with format=hf", field="format"
        )
    merged_by = merge_of(session, run) if format == "hf" and is_adapter else None
    if merged_by is not None and merged_by.output_path:
        folder = Path(merged_by.output_path)
    card = service.export_model_card(
        session=session, run=run, adapter=format == "adapter", merged_by=merged_by
    )
    name = f"{run.id}-{format}"
    return tar_response(folder, name, skip=RESUME_ONLY, extra={"README.md": card.encode()})
