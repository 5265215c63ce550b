"""The protobuf messages of the Tinker API, read and written by hand.

The `tinker` SDK sends `forward_backward` requests as protobuf and wants forward / forward-
backward / sample results back as protobuf (package `tinker_public`, proto3). The server reads
and writes the few messages it needs with this codec instead of depending on the client SDK's
generated classes; the tests check both directions against the SDK itself.

Wire format: each field is a varint key (field number << 3 | wire type) and a value: varint (0),
8 bytes (1), length-prefixed bytes (2) or 4 bytes (5). Maps are repeated {1: key, 2: value}.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from ...errors import TrilloraError

DTYPES = {1: np.float32, 2: np.int64, 3: np.int32, 4: "bfloat16"}  # tinker_public.DType
DTYPE_CODES = {np.dtype(np.float32): 1, np.dtype(np.int64): 2, np.dtype(np.int32): 3}
MAX_COLUMNS = 64
"""Values per token a loss input may hold: [N] inputs, or [N, K] top-k targets with K <= 64."""


class WireError(TrilloraError, ValueError):
    """A body that is not the protobuf message it claims to be."""


# --- reading ----------------------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf):
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def fields(buf: bytes) -> dict[int, list]:
    """{field number: [values]}: varints as int, length-delimited as bytes, fixed as raw bytes."""
    out: dict[int, list] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, i = _varint(buf, i)
        elif kind == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise WireError(f"field {number}: {n} bytes announced, {len(buf) - i} left")
            value, i = buf[i : i + n], i + n
        elif kind in (1, 5):
            size = 8 if kind == 1 else 4
            if i + size > len(buf):
                raise WireError(f"field {number}: truncated fixed-size value")
            value, i = buf[i : i + size], i + size
        else:
            raise WireError(f"field {number}: unsupported wire type {kind}")
        out.setdefault(number, []).append(value)
    return out


def _one(f: dict, number: int, default=None):
    return f[number][-1] if number in f else default


def _text(f: dict, number: int) -> str:
    return _one(f, number, b"").decode("utf-8")


def _map(f: dict, number: int) -> dict[str, bytes | int]:
    out = {}
    for entry in f.get(number, []):
        e = fields(entry)
        out[_text(e, 1)] = _one(e, 2, b"")
    return out


def read_tensor(buf: bytes, where: str, limit: int) -> np.ndarray:
    """A `Tensor` (dense or CSR) as a numpy array of its shape (1-D when no shape is given). `limit`:
    the most values it may declare; checked before anything of the declared shape is allocated."""
    f = fields(buf)
    code = _one(f, 3, 0)
    if code not in (1, 2):
        raise WireError(f"{where}: tensor dtype code {code}; requests carry float32 (1) or int64 (2)")
    dtype = np.dtype(DTYPES[code])
    shape = _repeated_ints(f.get(4, []))
    if any(n < 0 for n in shape) or math.prod(shape) > limit:
        raise WireError(f"{where}: shape {shape}; allowed: at most {limit} values (its datum's tokens × {MAX_COLUMNS})")
    if 1 in f:
        flat = _array(f[1][-1], dtype, where)
        if not shape:
            if flat.size > limit:
                raise WireError(f"{where}: {flat.size} values; allowed: at most {limit}")
            return flat
        if math.prod(shape) != flat.size:
            raise WireError(f"{where}: shape {shape} does not hold {flat.size} values")
        return flat.reshape(shape)
    if 2 in f:  # CSR: rows of the non-pad values, pad 0
        csr = fields(f[2][-1])
        values = _array(_one(csr, 1, b""), dtype, where)
        crow = _array(_one(csr, 2, b""), np.dtype(np.int64), where)
        col = _array(_one(csr, 3, b""), np.dtype(np.int64), where)
        return dense_from_csr(shape, values, crow, col, 0, where)
    return np.zeros(shape or [0], dtype=dtype)


def dense_from_csr(
    shape: list[int], values: np.ndarray, crow: np.ndarray, col: np.ndarray, fill, where: str
) -> np.ndarray:
    """A CSR tensor (row pointers `crow`, columns `col`) as a dense [R, C] array, `fill` where nothing
    is listed; pointers that go down or past the values and columns out of range are refused."""
    if (
        len(shape) != 2
        or len(crow) != shape[0] + 1
        or len(col) != len(values)
        or crow[0] != 0
        or crow[-1] != len(values)
        or (np.diff(crow) < 0).any()
        or (len(col) and (col.min() < 0 or col.max() >= shape[1]))
    ):
        raise WireError(
            f"{where}: sparse tensor of shape {shape} with row pointers {crow[:4].tolist()}... "
            f"(want 0 up to {len(values)}, never down) and {len(col)} columns (want 0..{shape[-1] - 1 if shape else 0})"
        )
    dense = np.full(shape, fill, dtype=values.dtype)
    for r in range(shape[0]):
        dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
    return dense


def _array(data: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise WireError(f"{where}: {len(data)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype)


def _repeated_ints(values: list) -> list[int]:
    """A repeated int64 field: packed (one length-delimited run of varints, proto3's default) or not."""
    out = []
    for v in values:
        if isinstance(v, bytes):
            i = 0
            while i < len(v):
                x, i = _varint(v, i)
                out.append(x)
        else:
            out.append(v)
    return [x - (1 << 64) if x >= 1 << 63 else x for x in out]


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    data: list[Datum]
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def read_forward_backward(buf: bytes, max_tokens: int) -> ForwardBackwardRequest:
    """`max_tokens`: the most tokens the call's datums may hold together (refused before they are read
    into lists); each loss input may hold at most MAX_COLUMNS values per token of its datum."""
    f = fields(buf)
    data, total = [], 0
    for k, raw in enumerate(f.get(3, [])):
        d = fields(raw)
        tokens: list[int] = []
        for chunk in d.get(1, []):
            c = fields(chunk)
            if 1 not in c:
                raise WireError(f"datum {k}: only encoded_text chunks are supported (no images or audio)")
            text = fields(c[1][-1])
            raw_tokens = _one(text, 1, b"")
            if len(raw_tokens) % 4:
                raise WireError(f"datum {k}: token bytes are not int32 values")
            total += len(raw_tokens) // 4
            if total > max_tokens:
                raise WireError(f"datum {k}: the call holds more than {max_tokens} tokens (--max-call-tokens)")
            tokens.extend(np.frombuffer(raw_tokens, dtype="<i4").tolist())
        limit = max(1, len(tokens)) * MAX_COLUMNS
        inputs = {name: read_tensor(t, f"datum {k} loss_fn_inputs[{name!r}]", limit) for name, t in _map(d, 2).items()}
        data.append(Datum(tokens, inputs))
    config: dict[str, float | str] = {k: struct.unpack("<d", v)[0] for k, v in _map(f, 5).items()}
    for key, raw in _map(f, 7).items():
        v = fields(raw)
        if 1 in v:
            config[key] = struct.unpack("<d", v[1][-1])[0]
        elif 2 in v:
            config[key] = v[2][-1].decode("utf-8")
    return ForwardBackwardRequest(
        model_id=_text(f, 1),
        seq_id=_one(f, 2, 0),
        loss_fn=_text(f, 4),
        data=data,
        loss_fn_config=config,
        forward_only=bool(_one(f, 6, 0)),
    )


# --- writing ----------------------------------------------------------------------------
def _put_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(number: int, kind: int) -> bytes:
    return _put_varint(number << 3 | kind)


def put_bytes(number: int, data: bytes) -> bytes:
    return _key(number, 2) + _put_varint(len(data)) + data


def put_varint(number: int, value: int) -> bytes:
    return _key(number, 0) + _put_varint(value) if value else b""  # proto3: defaults are not written


def put_double(number: int, value: float) -> bytes:
    return _key(number, 1) + struct.pack("<d", value)


def batched_tensor(rows: list[np.ndarray], dtype=np.float32) -> bytes:
    """One `BatchedTensor`: every datum's values concatenated, byte offsets between them."""
    dtype = np.dtype(dtype)
    parts = [np.ascontiguousarray(r, dtype=dtype.newbyteorder("<")).tobytes() for r in rows]
    offsets = np.cumsum([0] + [len(p) for p in parts]).astype("<i8")
    return put_bytes(1, b"".join(parts)) + put_bytes(2, offsets.tobytes()) + put_varint(3, DTYPE_CODES[dtype])


def forward_backward_output(outputs: dict[str, list[np.ndarray]], metrics: dict[str, float], num_datums: int) -> bytes:
    """`ForwardBackwardOutput` with one `ArrayRecord` holding every datum's outputs."""
    record = put_bytes(1, b"ArrayRecord")
    for name, rows in outputs.items():
        record += put_bytes(2, put_bytes(1, name.encode()) + put_bytes(2, batched_tensor(rows)))
    record += put_varint(3, num_datums)
    body = put_bytes(1, b"ArrayRecord") + put_bytes(2, record)
    for k, v in metrics.items():
        body += put_bytes(3, put_bytes(1, k.encode()) + put_double(2, float(v)))
    return body


def sample_response(
    sequences: list[tuple[list[int], list[float], str]],
    prompt_logprobs: list[float] | None = None,
    extras: dict | None = None,
) -> bytes:
    """`SampleResponse`: (tokens, logprobs, "stop" | "length") per sequence; prompt logprobs with
    NaN at the positions nothing scored (position 0); `extras` (`policy.logprobs.score_prompt`): "topk_sample" (per
    sequence), "topk_prompt", "targets", "alt"."""
    extras = extras or {}
    body = b""
    for i, (tokens, logprobs, reason) in enumerate(sequences):
        seq = put_varint(1, 0 if reason == "stop" else 1)
        seq += put_bytes(2, np.asarray(tokens, dtype="<i4").tobytes())
        seq += put_bytes(3, np.asarray(logprobs, dtype="<f4").tobytes())
        if "topk_sample" in extras:
            seq += put_bytes(4, _topk(*extras["topk_sample"][i]))
        body += put_bytes(1, seq)
    if prompt_logprobs is not None:
        body += put_bytes(2, np.asarray(prompt_logprobs, dtype="<f4").tobytes())
    if "topk_prompt" in extras:
        body += put_bytes(3, _topk(*extras["topk_prompt"]))
    if "targets" in extras:
        body += put_bytes(5, _tensor(extras["targets"]))
    if "alt" in extras:
        body += put_bytes(6, put_bytes(1, _tensor(extras["alt"][0])) + put_bytes(2, _tensor(extras["alt"][1])))
    return body


def _topk(ids: np.ndarray, logprobs: np.ndarray) -> bytes:
    """`TopkLogprobs`: dense [length, k] token ids (int32) and logprobs (float32)."""
    length, k = ids.shape
    return (
        put_bytes(1, np.ascontiguousarray(ids, dtype="<i4").tobytes())
        + put_bytes(2, np.ascontiguousarray(logprobs, dtype="<f4").tobytes())
        + put_varint(3, k)
        + put_varint(4, length)
    )


def _tensor(array: np.ndarray) -> bytes:
    """A dense `Tensor` (float32 or int64)."""
    return (
        put_bytes(1, np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes())
        + put_varint(3, DTYPE_CODES[np.dtype(array.dtype)])
        + put_bytes(4, b"".join(_put_varint(n) for n in array.shape))
    )
