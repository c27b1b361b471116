"""The Tinker protocol's protobuf messages (issue 40), declared field by field as the `tinker` SDK's generated
``tinker/proto/tinker_public_pb2.py`` has them (tests check every field against it), in a private descriptor
pool so they never clash with the SDK's own in one process. Protobuf only (the API reads a request's
``model_id`` with it, torch-free); trainer/primitives/wire.py converts to and from tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F: Any = descriptor_pb2.FieldDescriptorProto
# DType: FLOAT32, INT64, INT32
DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}
FLOAT32, INT64, INT32 = 1, 2, 3
STOP, LENGTH = 0, 1  # StopReason


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
