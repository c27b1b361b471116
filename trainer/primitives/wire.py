"""The binary half of the Tinker protocol (issue 40): the protobuf messages the `tinker` SDK sends for
``forward_backward`` and reads back for its results and samples, declared here field by field (the SDK
ships them only as generated code, ``tinker/proto/tinker_public_pb2.py``; tests check every field against
it), and their conversion to and from plain token lists and torch tensors. Torch and protobuf only.

Conventions of the wire (the SDK's ``proto/request_conv.py`` and ``response_conv.py``):

- a datum's ``model_input`` is a list of chunks; a text chunk's tokens are int32 little-endian bytes;
- ``loss_fn_inputs`` are tensors: ``dense`` bytes of ``dtype`` (``target_tokens`` int64, float inputs
  float32) with ``shape``, or ``sparse_csr`` (values, int64 row starts and column indices) of that shape;
- results: ``ForwardBackwardOutput`` holds one record of per-datum float32 tensors concatenated, with int64
  *byte* offsets (B + 1 of them), and ``metrics`` keyed ``name:reduction``; ``SampleResponse`` holds each
  sequence's int32 tokens and float32 log-probs, and optionally the prompt's log-probs with NaN first.

The messages live in a private descriptor pool, so they never clash with the SDK's own in one process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F: Any = descriptor_pb2.FieldDescriptorProto
# DType: FLOAT32, INT64, INT32
DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}
FLOAT32, INT64, INT32 = 1, 2, 3
STOP, LENGTH = 0, 1  # StopReason


class WireError(ValueError):
    """A request the SDK sent that cannot be read as a training batch; ``field`` names where."""

    def __init__(self, message: str, field: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _field(
    name: str,
    number: int,
    kind: int,
    *,
    repeated: bool = False,
    type_name: str = "",
    oneof: int | None = None,
) -> Any:
    f = _F(name=name, number=number, type=kind, label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if type_name:
        f.type_name = f".tinker_public.{type_name}"
    if oneof is not None:
        f.oneof_index = oneof
    return f


def _message(
    file: descriptor_pb2.FileDescriptorProto, name: str, fields: list[Any], oneofs: Sequence[str] = ()
) -> descriptor_pb2.DescriptorProto:
    m = file.message_type.add(name=name)
    m.field.extend(fields)
    for o in oneofs:
        m.oneof_decl.add(name=o)
    return m


def _map(
    owner: descriptor_pb2.DescriptorProto,
    name: str,
    number: int,
    value: int,
    value_type: str = "",
) -> None:
    """A ``map<string, value>`` field ``name`` of ``owner`` (its entry message nested, as protoc does)."""
    entry = owner.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
    entry.options.map_entry = True
    entry.field.extend([_field("key", 1, _F.TYPE_STRING), _field("value", 2, value, type_name=value_type)])
    owner.field.append(
        _field(name, number, _F.TYPE_MESSAGE, repeated=True, type_name=f"{owner.name}.{entry.name}")
    )


def _schema() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(
        name="rlrun_tinker_wire.proto", package="tinker_public", syntax="proto3"
    )
    dtype = f.enum_type.add(name="DType")
    for n, v in [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ]:
        dtype.value.add(name=n, number=v)
    stop = f.enum_type.add(name="StopReason")
    for n, v in [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)]:
        stop.value.add(name=n, number=v)
    B, S, M, E = _F.TYPE_BYTES, _F.TYPE_STRING, _F.TYPE_MESSAGE, _F.TYPE_ENUM
    _message(f, "EncodedTextChunk", [_field("tokens", 1, B)])
    _message(f, "Chunk", [_field("encoded_text", 1, M, type_name="EncodedTextChunk", oneof=0)], ["chunk"])
    _message(
        f, "SparseCsr", [_field("values", 1, B), _field("crow_indices", 2, B), _field("col_indices", 3, B)]
    )
    _message(
        f,
        "Tensor",
        [
            _field("dense", 1, B, oneof=0),
            _field("sparse_csr", 2, M, type_name="SparseCsr", oneof=0),
            _field("dtype", 3, E, type_name="DType"),
            _field("shape", 4, _F.TYPE_INT64, repeated=True),
        ],
        ["encoding"],
    )
    datum = _message(f, "Datum", [_field("model_input", 1, M, repeated=True, type_name="Chunk")])
    _map(datum, "loss_fn_inputs", 2, M, "Tensor")
    _message(
        f,
        "LossConfigValue",
        [_field("number", 1, _F.TYPE_DOUBLE, oneof=0), _field("text", 2, S, oneof=0)],
        ["value"],
    )
    request = _message(
        f,
        "ForwardBackwardRequest",
        [
            _field("model_id", 1, S),
            _field("seq_id", 2, _F.TYPE_INT32),
            _field("data", 3, M, repeated=True, type_name="Datum"),
            _field("loss_fn", 4, S),
            _field("forward_only", 6, _F.TYPE_BOOL),
        ],
    )
    _map(request, "loss_fn_config", 5, _F.TYPE_DOUBLE)
    _map(request, "loss_fn_config_v2", 7, M, "LossConfigValue")
    _message(
        f,
        "BatchedTensor",
        [
            _field("data", 1, B),
            _field("offsets", 2, B),
            _field("dtype", 3, E, type_name="DType"),
            _field("trailing_shape", 4, _F.TYPE_INT64, repeated=True),
        ],
    )
    record = _message(f, "ArrayRecord", [_field("type_tag", 1, S), _field("num_datums", 3, _F.TYPE_INT64)])
    _map(record, "fields", 2, M, "BatchedTensor")
    output = _message(
        f,
        "ForwardBackwardOutput",
        [
            _field("loss_fn_output_type", 1, S),
            _field("loss_fn_outputs", 2, M, repeated=True, type_name="ArrayRecord"),
        ],
    )
    _map(output, "metrics", 3, _F.TYPE_DOUBLE)
    _message(
        f,
        "SampledSequence",
        [
            _field("stop_reason", 1, E, type_name="StopReason"),
            _field("tokens", 2, B),
            _field("logprobs", 3, B),
        ],
    )
    _message(
        f,
        "SampleResponse",
        [
            _field("sequences", 1, M, repeated=True, type_name="SampledSequence"),
            _field("prompt_logprobs", 2, B),
            _field("prompt_cache_hit_tokens", 4, _F.TYPE_INT32),
        ],
    )
    return f


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_schema())


def message_class(name: str) -> Any:
    """The class of message ``tinker_public.<name>`` of this module's schema."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tinker_public.{name}"))


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
