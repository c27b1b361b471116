"""The binary half of the Tinker protocol (issue 40): the protobuf messages the `tinker` SDK sends for
``forward_backward`` and reads back for its results and samples (declared in trainer/primitives/schema.py)
converted to and from plain token lists and torch tensors.

Conventions of the wire (the SDK's ``proto/request_conv.py`` and ``response_conv.py``):

- a datum's ``model_input`` is a list of chunks; a text chunk's tokens are int32 little-endian bytes;
- ``loss_fn_inputs`` are tensors: ``dense`` bytes of ``dtype`` (``target_tokens`` int64, float inputs
  float32) with ``shape``, or ``sparse_csr`` (values, int64 row starts and column indices) of that shape;
- results: ``ForwardBackwardOutput`` holds one record of per-datum float32 tensors concatenated, with int64
  *byte* offsets (B + 1 of them), and ``metrics`` keyed ``name:reduction``; ``SampleResponse`` holds each
  sequence's int32 tokens and float32 log-probs, and optionally the prompt's log-probs with NaN first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.primitives.schema import DTYPES, FLOAT32, INT32, INT64, LENGTH, STOP, message_class


class WireError(ValueError):
    """A request the SDK sent that cannot be read as a training batch; ``field`` names where."""

    def __init__(self, message: str, field: str):
        super().__init__(f"{field}: {message}")
        self.field = field


ForwardBackwardRequestPb = message_class("ForwardBackwardRequest")
ForwardBackwardOutputPb = message_class("ForwardBackwardOutput")
SampleResponsePb = message_class("SampleResponse")


@dataclass(frozen=True)
class Datum:
    """One training sequence: its input ``tokens`` (N) and its loss inputs, each an (N,) tensor."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool


def _array(raw: bytes, dtype: np.dtype[Any], field: str) -> np.ndarray[Any, Any]:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{len(raw)} bytes is not a whole number of {dtype.name} values", field)
    return np.frombuffer(raw, dtype=dtype)


def _tensor(t: Any, field: str) -> torch.Tensor:
    """A wire ``Tensor`` as a dense torch tensor of its shape (int64 or float32)."""
    dtype = DTYPES.get(int(t.dtype))
    if dtype is None:
        raise WireError(f"dtype {int(t.dtype)} is not supported (float32, int64 or int32)", field)
    shape = [int(d) for d in t.shape]
    size = math.prod(shape)
    which = t.WhichOneof("encoding")
    if which == "sparse_csr":
        if len(shape) != 2:
            raise WireError(f"a sparse tensor must be 2-D, got shape {shape}", field)
        csr = t.sparse_csr
        crow = _array(csr.crow_indices, DTYPES[INT64], field).astype(np.int64)
        col = _array(csr.col_indices, DTYPES[INT64], field).astype(np.int64)
        values = _array(csr.values, dtype, field)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(col) and col.max() >= shape[1]):
            raise WireError("the sparse tensor's indices do not fit its shape", field)
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        array = dense
    else:
        array = _array(t.dense, dtype, field)
        if array.size != size:
            raise WireError(f"{array.size} values do not fill shape {shape}", field)
        array = array.reshape(shape)
    out = torch.from_numpy(array.copy())
    return out.long() if out.dtype in (torch.int32, torch.int64) else out.float()


def parse_forward_backward(raw: bytes) -> ForwardBackwardRequest:
    """A ``forward_backward`` (or ``forward``) request body.

    Raises:
        WireError: not a request, a chunk that is not text (images are not supported), a datum without
            tokens, or a tensor whose bytes do not fit its shape and dtype.
    """
    msg = ForwardBackwardRequestPb()
    try:
        msg.ParseFromString(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise WireError(f"not a ForwardBackwardRequest ({type(exc).__name__})", "body") from None
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for k, chunk in enumerate(d.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError("only text chunks are supported", f"data[{i}].model_input[{k}]")
            tokens += _array(chunk.encoded_text.tokens, DTYPES[INT32], f"data[{i}].model_input[{k}]").tolist()
        if not tokens:
            raise WireError("a datum needs at least one token", f"data[{i}].model_input")
        inputs = {
            name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}") for name, t in d.loss_fn_inputs.items()
        }
        data.append(Datum(tokens=tokens, inputs=inputs))
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    return ForwardBackwardRequest(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        data=data,
        loss_fn=msg.loss_fn,
        config=config,
        forward_only=bool(msg.forward_only),
    )


def _batched(rows: Sequence[torch.Tensor]) -> Any:
    """Per-datum 1-D float tensors as one ``BatchedTensor`` (float32 data, int64 byte offsets)."""
    arrays = [r.detach().to(torch.float32).cpu().numpy().astype("<f4") for r in rows]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    out = message_class("BatchedTensor")()
    out.data = b"".join(a.tobytes() for a in arrays)
    out.offsets = offsets.tobytes()
    out.dtype = FLOAT32
    return out


def forward_backward_output(
    outputs: Mapping[str, Sequence[torch.Tensor]], metrics: Mapping[str, float], output_type: str
) -> bytes:
    """A ``ForwardBackwardOutput``: ``outputs`` name -> one 1-D tensor per datum (``logprobs``,
    ``elementwise_loss``), ``metrics`` keyed ``name:reduction`` (finite).

    Raises:
        ValueError: a metric key without exactly one ``:``, or a value that is not finite.
    """
    for key, value in metrics.items():
        if key.count(":") != 1 or not math.isfinite(value):
            raise ValueError(f"metric {key!r} = {value!r}: keys are name:reduction, values finite")
    msg = ForwardBackwardOutputPb(loss_fn_output_type=output_type)
    if outputs:
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(next(iter(outputs.values())))
        for name, rows in outputs.items():
            record.fields[name].CopyFrom(_batched(rows))
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    data: bytes = msg.SerializeToString()
    return data


@dataclass(frozen=True)
class Sampled:
    """One sampled continuation: its tokens, their log-probs, and whether it stopped (else: length)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def sample_response(sequences: Sequence[Sampled], prompt_logprobs: Sequence[float] | None = None) -> bytes:
    """A ``SampleResponse``; ``prompt_logprobs`` (one per prompt token after the first) go on the wire
    with NaN first, which the SDK reads as None."""
    msg = SampleResponsePb()
    for s in sequences:
        if len(s.tokens) != len(s.logprobs):
            raise ValueError(f"{len(s.tokens)} tokens but {len(s.logprobs)} log-probs")
        seq = msg.sequences.add()
        seq.stop_reason = STOP if s.stopped else LENGTH
        seq.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan, *prompt_logprobs], dtype="<f4").tobytes()
    data: bytes = msg.SerializeToString()
    return data
