"""Issue 40's foundation: rlrun's own declaration of the Tinker wire messages agrees field for field with
the official SDK's generated code, reads the request bytes the SDK writes, and writes result bytes the
SDK's own decoders read back; the built-in losses agree with their formulas computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto import response_conv
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from trainer.primitives.losses import check_config, check_datum, per_token_loss
from trainer.primitives.wire import (
    Datum,
    Sampled,
    WireError,
    forward_backward_output,
    message_class,
    parse_forward_backward,
    sample_response,
)

MESSAGES = [
    "EncodedTextChunk",
    "Chunk",
    "SparseCsr",
    "Tensor",
    "Datum",
    "LossConfigValue",
    "ForwardBackwardRequest",
    "BatchedTensor",
    "ArrayRecord",
    "ForwardBackwardOutput",
    "SampledSequence",
    "SampleResponse",
]


@pytest.mark.parametrize("name", MESSAGES)
def test_every_field_matches_the_sdks_schema(name: str) -> None:
    ours = message_class(name).DESCRIPTOR
    theirs = sdk_pb.DESCRIPTOR.message_types_by_name[name]
    for field in ours.fields:
        sdk = theirs.fields_by_name[field.name]
        assert (field.number, field.type, field.is_repeated) == (sdk.number, sdk.type, sdk.is_repeated), (
            field.name
        )
        if field.message_type is not None:
            assert field.message_type.name == sdk.message_type.name, field.name
        if field.enum_type is not None:
            assert [(v.name, v.number) for v in field.enum_type.values] == [
                (v.name, v.number) for v in sdk.enum_type.values
            ][: len(field.enum_type.values)]


def sdk_request(data: list[types.Datum], loss_fn: str = "cross_entropy", config: dict | None = None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),  # type: ignore[arg-type]
        model_id="s:train:0",
        seq_id=3,
    )
    raw: bytes = forward_backward_request_to_proto(request).SerializeToString()
    return raw


def test_the_sdks_request_bytes_are_read_as_datums() -> None:
    first = types.Datum(
        model_input=types.ModelInput.from_ints([10, 11, 12]),
        loss_fn_inputs={"target_tokens": [11, 12, 13], "weights": [0.0, 1.0, 1.0]},
    )
    second = types.Datum(
        model_input=types.ModelInput.from_ints([7, 70000]),
        loss_fn_inputs={"target_tokens": [70000, 2], "logprobs": [-1.5, -0.25], "advantages": [0.5, 0.5]},
    )
    got = parse_forward_backward(sdk_request([first, second], "ppo", {"clip_low_threshold": 0.7}))
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s:train:0", 3, "ppo", False)
    assert got.config == {"clip_low_threshold": 0.7}
    assert got.data[0].tokens == [10, 11, 12] and got.data[1].tokens == [7, 70000]
    assert got.data[0].inputs["target_tokens"].tolist() == [11, 12, 13]
    assert got.data[0].inputs["target_tokens"].dtype == torch.int64
    assert got.data[0].inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    assert got.data[1].inputs["logprobs"].tolist() == [-1.5, -0.25]


def test_a_sparse_tensor_and_several_chunks_are_read_dense() -> None:
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([1, 2], "<i4").tobytes()
    d.model_input.add().encoded_text.tokens = np.asarray([3], "<i4").tobytes()
    t = d.loss_fn_inputs["weights"]
    t.dtype, t.shape[:] = sdk_pb.DTYPE_FLOAT32, [2, 3]
    t.sparse_csr.values = np.asarray([5.0, 6.0], "<f4").tobytes()
    t.sparse_csr.crow_indices = np.asarray([0, 1, 2], "<i8").tobytes()
    t.sparse_csr.col_indices = np.asarray([2, 0], "<i8").tobytes()
    got = parse_forward_backward(msg.SerializeToString())
    assert got.data[0].tokens == [1, 2, 3]
    assert got.data[0].inputs["weights"].tolist() == [[0.0, 0.0, 5.0], [6.0, 0.0, 0.0]]


def test_unreadable_requests_are_refused_naming_the_field() -> None:
    with pytest.raises(WireError, match="not a ForwardBackwardRequest") as caught:
        parse_forward_backward(b"\xff\xff\xff")
    assert caught.value.field == "body"
    image = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    image.data.add().model_input.add().image.data = b"png"
    with pytest.raises(WireError, match="only text chunks") as caught:
        parse_forward_backward(image.SerializeToString())
    assert caught.value.field == "data[0].model_input[0]"
    short = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    d = short.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([1, 2], "<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = sdk_pb.DTYPE_INT64
    d.loss_fn_inputs["target_tokens"].shape[:] = [2]
    d.loss_fn_inputs["target_tokens"].dense = np.asarray([2], "<i8").tobytes()
    with pytest.raises(WireError, match="do not fill shape") as caught:
        parse_forward_backward(short.SerializeToString())
    assert caught.value.field == "data[0].loss_fn_inputs.target_tokens"


def test_results_are_read_back_by_the_sdks_decoders() -> None:
    logprobs = [torch.tensor([-0.5, -1.25, -2.0]), torch.tensor([-3.0])]
    raw = forward_backward_output({"logprobs": logprobs}, {"loss:sum": 6.75}, "CrossEntropyLossReturn")
    out = response_conv.deserialize_forward_backward_output(raw)
    assert out.metrics == {"loss:sum": 6.75}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.25, -2.0], [-3.0]]
    with pytest.raises(ValueError, match="name:reduction"):
        forward_backward_output({}, {"loss": 1.0}, "x")
    with pytest.raises(ValueError, match="name:reduction"):
        forward_backward_output({}, {"loss:sum": math.nan}, "x")
    samples = sample_response(
        [Sampled([5, 6, 7], [-0.5, -0.25, -0.125], stopped=False), Sampled([9], [-1.0], stopped=True)],
        prompt_logprobs=[-1.0, -2.0],
    )
    res = response_conv.deserialize_sample_response(samples)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences] == [
        ([5, 6, 7], [-0.5, -0.25, -0.125], "length"),
        ([9], [-1.0], "stop"),
    ]
    assert res.prompt_logprobs == [None, -1.0, -2.0]


def datum(n: int, **inputs: list[float]) -> Datum:
    return Datum(tokens=list(range(n)), inputs={k: torch.tensor(v) for k, v in inputs.items()})


def test_losses_agree_with_their_formulas_by_hand() -> None:
    lp = torch.tensor([-1.0, -0.5, -2.0])
    q = torch.tensor([-1.2, -0.5, -1.0])  # r = exp(0.2), 1, exp(-1)
    adv = torch.tensor([1.0, -2.0, 3.0])
    inputs = {"logprobs": q, "advantages": adv}
    r = [math.exp(0.2), 1.0, math.exp(-1.0)]
    ce = per_token_loss("cross_entropy", lp, {"weights": torch.tensor([0.0, 1.0, 2.0])}, None)
    assert ce.tolist() == pytest.approx([0.0, 0.5, 4.0])
    assert per_token_loss("importance_sampling", lp, inputs, None).tolist() == pytest.approx(
        [-r[0] * 1.0, -r[1] * -2.0, -r[2] * 3.0]
    )
    clip = check_config("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.1})
    # token 0: A > 0, r = 1.221 > 1.1: the clipped 1.1 A is the smaller objective; token 2: r = 0.368 < 0.8
    # with A > 0: min(r A, 0.8 A) = r A
    assert per_token_loss("ppo", lp, inputs, clip).tolist() == pytest.approx([-1.1, 2.0, -r[2] * 3.0])
    cispo = per_token_loss("cispo", lp, inputs, clip)  # -clip(r) A lp, the weight a constant
    assert cispo.tolist() == pytest.approx([-1.1 * 1.0 * -1.0, -1.0 * -2.0 * -0.5, -0.8 * 3.0 * -2.0])
    leaf = lp.clone().requires_grad_(True)
    per_token_loss("cispo", leaf, inputs, clip).sum().backward()
    assert leaf.grad is not None and leaf.grad.tolist() == pytest.approx([-1.1, 2.0, -2.4])


def test_bad_datums_and_configs_are_refused_naming_the_field() -> None:
    ok = datum(2, target_tokens=[1, 2], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])
    check_datum("ppo", ok, "data[0]")
    cases = [
        ("dro", ok, "loss_fn"),
        ("ppo", datum(2, target_tokens=[1, 2]), "data[0].loss_fn_inputs.logprobs"),
        ("cross_entropy", ok, "data[0].loss_fn_inputs.logprobs"),
        ("cross_entropy", datum(2, target_tokens=[1, 2, 3]), "data[0].loss_fn_inputs.target_tokens"),
    ]
    for loss_fn, d, field in cases:
        with pytest.raises(WireError) as caught:
            check_datum(loss_fn, d, "data[0]")
        assert caught.value.field == field, (loss_fn, str(caught.value))
    with pytest.raises(WireError) as caught:
        check_config("cross_entropy", {"clip_low_threshold": 0.8})
    assert caught.value.field == "loss_fn_config.clip_low_threshold"
    with pytest.raises(WireError, match="need 0 <= clip_low_threshold"):
        check_config("ppo", {"clip_high_threshold": 0.9})
