"""The hand-written protobuf codec against the `tinker` SDK's own encoders and decoders."""

import math

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402

from trillora.serve.tinker import wire  # noqa: E402


def sdk_request(data, loss_fn="ppo", config=None):
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=3,
    )
    return request_conv.forward_backward_request_to_proto(req).SerializeToString()


def test_forward_backward_requests_read_as_the_sdk_writes_them():
    dense = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-0.5, -1.5, -2.0], "advantages": [1.0, 1.0, -3.25]},
    )
    two_chunks = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[7]), types.EncodedTextChunk(tokens=[100000, 9])]
        ),
        loss_fn_inputs={
            "target_tokens": torch.tensor([[1, 0], [0, 5], [2, 3]]),  # 2-D: may go sparse
            "weights": torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.0, 0.0]]),
        },
    )
    got = wire.read_forward_backward(
        sdk_request([dense, two_chunks], config={"clip_low_threshold": 0.7, "mode": "x"}), 100
    )
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s:train:0", 3, "ppo", False)
    assert got.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "mode": "x"}
    assert got.data[0].tokens == [1, 2, 3] and got.data[1].tokens == [7, 100000, 9]
    assert got.data[0].inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(got.data[0].inputs["target_tokens"], [2, 3, 4])
    np.testing.assert_allclose(got.data[0].inputs["advantages"], [1.0, 1.0, -3.25])
    np.testing.assert_array_equal(got.data[1].inputs["target_tokens"], [[1, 0], [0, 5], [2, 3]])
    np.testing.assert_allclose(got.data[1].inputs["weights"], [[1.0, 0.0], [0.0, 0.5], [0.0, 0.0]])


def test_forward_backward_output_decodes_in_the_sdk():
    body = wire.forward_backward_output(
        {"logprobs": [np.array([-1.0, -2.0, -3.0]), np.array([-0.5])]}, {"loss:sum": 6.5}, 2
    )
    out = response_conv.deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 6.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [-0.5]]


def test_sample_response_decodes_in_the_sdk():
    body = wire.sample_response([([5, 6], [-0.1, -0.2], "length"), ([7], [-0.3], "stop")], [math.nan, -1.5, -2.5])
    out = response_conv.deserialize_sample_response(body)
    assert [s.tokens for s in out.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in out.sequences] == ["length", "stop"]
    assert out.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert out.prompt_logprobs[0] is None or math.isnan(out.prompt_logprobs[0])
    assert out.prompt_logprobs[1:] == pytest.approx([-1.5, -2.5])


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\x1a\x05\x0a\x03", "announced"),  # a datum claiming 5 bytes with 4 left
        (b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "varint longer"),
        (b"\x0b", "unsupported wire type 3"),
    ],
)
def test_broken_bodies_are_wire_errors(body, message):
    with pytest.raises(wire.WireError, match=message):
        wire.read_forward_backward(body, 100)


def tensor(shape: list[int], dtype: int = 1, data: bytes | None = None, csr: tuple | None = None) -> bytes:
    out = wire.put_varint(3, dtype) + wire.put_bytes(4, b"".join(wire._put_varint(n) for n in shape))
    if data is not None:
        out += wire.put_bytes(1, data)
    if csr is not None:
        values, crow, col = csr
        out += wire.put_bytes(
            2,
            wire.put_bytes(1, np.array(values, "<f4").tobytes())
            + wire.put_bytes(2, np.array(crow, "<i8").tobytes())
            + wire.put_bytes(3, np.array(col, "<i8").tobytes()),
        )
    return out


def request(tokens: list[int], **inputs: bytes) -> bytes:
    chunk = wire.put_bytes(1, wire.put_bytes(1, np.array(tokens, "<i4").tobytes()))
    entries = b"".join(
        wire.put_bytes(2, wire.put_bytes(1, k.encode()) + wire.put_bytes(2, v)) for k, v in inputs.items()
    )
    return wire.put_bytes(3, wire.put_bytes(1, chunk) + entries)


@pytest.mark.parametrize(
    "weights, message",
    [
        (tensor([3, 50_000_000]), "at most 192 values"),  # a declared shape with no data: refused, nothing allocated
        (tensor([3, 2_000_000], csr=([1.0], [0, 1, 1, 1], [0])), "at most 192 values"),
        (tensor([-1, 3]), "shape"),
        (tensor([2, 4], csr=([1.0], [0, 1, 1], [-1])), "columns"),  # a negative column
        (tensor([2, 4], csr=([1.0, 2.0], [0, 2, 1], [0, 1])), "never down"),  # row pointers that go down
        (tensor([2, 4], csr=([1.0], [0, 1, 9], [0])), "never down"),  # ... or run past the values
        (tensor([3], data=b"\x00" * 5), "whole number"),
    ],
)
def test_hostile_tensors_are_refused_before_allocation(weights, message):
    import tracemalloc

    tracemalloc.start()
    with pytest.raises(wire.WireError, match=message):
        wire.read_forward_backward(request([1, 2, 3], weights=weights), 100)
    assert tracemalloc.get_traced_memory()[1] < 1 << 20  # peak: the declared shape was never allocated
    tracemalloc.stop()


def test_tokens_past_the_call_bound_are_refused_before_they_are_read():
    with pytest.raises(wire.WireError, match="more than 100 tokens"):
        wire.read_forward_backward(request(list(range(60))) + request(list(range(60))), 100)
    assert len(wire.read_forward_backward(request(list(range(60))) + request(list(range(40))), 100).data) == 2


def test_target_ids_as_json_csr_share_the_protobuf_checks():
    """`target_prompt_logprobs` arrives as JSON TensorData; its CSR form goes through the same
    `dense_from_csr` as a protobuf tensor: listed cells filled, the rest -1, bad pointers refused."""
    from trillora.serve.calls import BadRequest
    from trillora.serve.tinker.checks import sample_options

    good = {
        "data": [5, 7],
        "dtype": "int64",
        "shape": [3, 2],
        "sparse_crow_indices": [0, 1, 1, 2],
        "sparse_col_indices": [1, 0],
    }
    got = sample_options({"target_prompt_logprobs": good}, 4, 100)["target_prompt_logprobs"]
    np.testing.assert_array_equal(got, [[-1, 5], [-1, -1], [7, -1]])
    with pytest.raises(BadRequest, match="never down"):
        sample_options({"target_prompt_logprobs": {**good, "sparse_crow_indices": [0, 2, 1, 2]}}, 4, 100)


def test_adam_settings_take_the_sdk_defaults_and_refuse_what_torch_would_not_run():
    from tinker import AdamParams

    from trillora.serve.calls import BadRequest
    from trillora.serve.tinker.checks import adam_settings

    sdk = AdamParams()  # the SDK's own defaults are what a client that sends none gets
    assert adam_settings({}) == (sdk.learning_rate, sdk.beta1, sdk.beta2, sdk.eps, sdk.weight_decay, 0.0)
    assert adam_settings({"learning_rate": 1e-3, "beta1": 0}) == (1e-3, 0, sdk.beta2, sdk.eps, sdk.weight_decay, 0.0)
    for key, value in [
        ("beta1", 1.0), ("beta2", -0.1), ("eps", -1e-8), ("learning_rate", True),
        ("weight_decay", float("nan")), ("grad_clip_norm", "1"), ("learning_rate", float("inf")),
    ]:  # fmt: skip
        with pytest.raises(BadRequest, match=rf"adam_params\.{key}="):
            adam_settings({key: value})
