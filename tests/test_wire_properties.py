"""Property tests of the wire format over generated nested values with arrays and tensors."""

from __future__ import annotations

import contextlib
import math
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from evenflow.transports import _wirec
from evenflow.transports._wire import (
    _PREFIX,
    _decode_frame,
    decode,
    decode_many,
    encode,
    encode_many,
)
from evenflow.transports.errors import WireFormatError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUMPY_DTYPES = st.sampled_from(
    [
        *["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"],
        *["float16", "float32", "float64", "complex64", "complex128", ">i4", ">f8"],
    ]
)
TORCH_DTYPES = st.sampled_from(
    [
        *[torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16],
        *[torch.bfloat16, torch.float32, torch.float64, torch.complex64],
        getattr(torch, "float8_e4m3fn", torch.float32),
    ]
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    arr = draw(hnp.arrays(NUMPY_DTYPES, SHAPES))
    if arr.ndim >= 2 and draw(st.booleans()):
        arr = arr.T  # non-contiguous
    return arr


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    values = draw(hnp.arrays(np.float64, SHAPES, elements=st.floats(-1e3, 1e3)))
    tensor = torch.from_numpy(values).to(draw(TORCH_DTYPES))
    if tensor.ndim >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, 1)
    return tensor


LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
    | st.binary(min_size=8192, max_size=8300)  # travels in the body, not the header
    | st.binary(max_size=20).map(bytearray)
    | st.sampled_from([np.int32(7), np.float16(0.5), np.bool_(False), np.uint64(2**64 - 1)])
    | arrays()
    | tensors()
)
VALUES = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def assert_same(got: Any, want: Any) -> None:
    """Deep equality that also checks container types, dtypes, shapes and exact bits."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor and got.dtype == want.dtype
        assert got.shape == want.shape and got.is_contiguous()
        fresh = [torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1) for t in (got, want)]
        assert torch.equal(fresh[0].view(torch.uint8), fresh[1].view(torch.uint8))
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray and got.shape == want.shape
        assert got.dtype == want.dtype.newbyteorder("<") and got.flags.c_contiguous
        assert got.tobytes() == want.astype(got.dtype).tobytes()
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got.tobytes() == want.tobytes()
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want)
        for key, value in want.items():
            assert_same(got[key], value)
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    elif isinstance(want, float) and math.isnan(want):
        assert type(got) is float and math.isnan(got)
    else:
        assert type(got) is type(want) and got == want


@SETTINGS
@given(VALUES)
def test_every_generated_value_round_trips(value: Any) -> None:
    frame = encode(value)
    assert frame.size % 64 == 0
    assert_same(decode(frame), value)
    assert_same(decode(frame.tobytes()), value)  # read-only input: same values


@SETTINGS
@given(st.lists(VALUES | st.just(None), max_size=5))
def test_encode_many_round_trips_through_decode_many(values: list[Any]) -> None:
    buffer, sizes = encode_many(values)
    assert len(sizes) == len(values) and sum(sizes) == buffer.size
    assert_same(decode_many(torch.from_numpy(buffer), sizes), values)


@SETTINGS
@given(VALUES, st.data())
def test_damaged_frames_decode_or_raise_wire_format_error(value: Any, data: st.DataObject) -> None:
    frame = bytearray(encode(value).tobytes())
    cut = data.draw(st.integers(1, len(frame) - 1))
    with pytest.raises(WireFormatError):
        decode(frame[:cut])
    for _ in range(4):
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] = data.draw(st.integers(0, 255))
    with contextlib.suppress(WireFormatError):
        decode(frame)  # damage inside a number or an array's data can stay undetected


# -- the compiled decoder against the checked Python path ----------------------------------------


def compiled(frame: bytes | bytearray) -> Any:
    """What the compiled decoder alone makes of ``frame`` (NotImplemented: it declines)."""
    decoded = _wirec.decode_many(memoryview(frame), [len(frame)], 1 << 31)
    return decoded if decoded is NotImplemented else decoded[0]


def checked(frame: bytes | bytearray) -> Any:
    return _decode_frame(memoryview(frame), 1 << 31, fast=False)


@SETTINGS
@given(VALUES)
def test_the_compiled_decoder_builds_what_the_checked_path_builds(value: Any) -> None:
    for frame in (bytearray(encode(value).tobytes()), encode(value).tobytes()):
        fast = compiled(frame)
        if fast is NotImplemented:  # only numpy scalars are left to the Python path
            assert any(isinstance(v, np.generic) for v in _leaves(value))
            continue
        assert_same(fast, value)
        assert_same(fast, checked(frame))


@SETTINGS
@given(VALUES, st.data())
def test_the_compiled_decoder_accepts_a_damaged_frame_only_as_the_checked_path_does(
    value: Any, data: st.DataObject
) -> None:
    frame = bytearray(encode(value).tobytes())
    header_len = _PREFIX.unpack_from(frame)[4]
    for _ in range(data.draw(st.integers(1, 4))):
        # Mostly the header, where the decoders differ; sometimes the lengths in the prefix.
        position = data.draw(st.integers(8, _PREFIX.size + header_len - 1))
        frame[position] = data.draw(st.integers(0, 255))
    fast = compiled(frame)
    try:
        slow = checked(frame)
    except WireFormatError:
        assert fast is NotImplemented  # whatever the checked path refuses, C declines
        return
    if fast is not NotImplemented:
        assert_same(fast, slow)


def checked_many(buffer: bytes | bytearray, sizes: list[int]) -> list[Any]:
    """Frame by frame through the checked path, as decode_many does when C declines."""
    out, position = [], 0
    for size in sizes:
        out.append(checked(buffer[position : position + size]) if size else None)
        position += size
    return out


@SETTINGS
@given(st.lists(VALUES | st.just(None), max_size=4), st.data())
def test_the_compiled_decode_many_agrees_with_frame_by_frame_decoding(
    values: list[Any], data: st.DataObject
) -> None:
    encoded, sizes = encode_many(values)
    buffer = bytearray(encoded.tobytes())
    fast = _wirec.decode_many(memoryview(buffer), sizes, 1 << 31)
    if fast is NotImplemented:
        assert any(isinstance(v, np.generic) for v in _leaves(values))
    else:
        assert_same(fast, values)
    if not buffer:
        return
    for _ in range(data.draw(st.integers(1, 4))):  # prefixes and headers alike
        position = data.draw(st.integers(0, len(buffer) - 1))
        buffer[position] = data.draw(st.integers(0, 255))
    fast = _wirec.decode_many(memoryview(buffer), sizes, 1 << 31)
    try:
        slow = checked_many(buffer, sizes)
    except WireFormatError:
        assert fast is NotImplemented
        return
    if fast is not NotImplemented:
        assert_same(fast, slow)


@pytest.mark.parametrize("body_len", [(1 << 64) - 64, (1 << 63), 64 * 10**9])
def test_a_body_length_beyond_the_frame_is_declined_and_refused(body_len: int) -> None:
    frame = bytearray(encode({"tokens": np.arange(40, dtype=np.int32)}).tobytes())
    struct.pack_into("<Q", frame, 12, body_len)
    assert _wirec.decode_many(memoryview(frame), [len(frame)], 1 << 31) is NotImplemented
    with pytest.raises(WireFormatError, match="frame 0 of 1"):
        decode_many(frame, [len(frame)])


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]
