"""The wire format: round trips, encode errors, hostile input, aliasing and copy counts."""

from __future__ import annotations

import contextlib
import enum
import math
import random
import re
import struct
import time
import tracemalloc
from collections import OrderedDict, namedtuple
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from evenflow.transports._wire import (
    DEFAULT_MAX_FRAME_BYTES,
    decode,
    decode_many,
    encode,
    encode_many,
)
from evenflow.transports.errors import EncodeError, WireFormatError

PREFIX = struct.Struct("<4sBBHIQ")
NUMPY_DTYPES = [
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
TORCH_DTYPES = [
    getattr(torch, name)
    for name in [
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
    if isinstance(getattr(torch, name, None), torch.dtype)
]
SHAPES = [(), (0,), (5,), (2, 3), (0, 4), (2, 0, 3), (1, 1, 1, 2)]


def assert_same(got: Any, want: Any, where: str = "obj") -> None:
    """Deep equality that also checks types, dtypes, shapes and exact bits."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.is_contiguous() and not got.requires_grad, where
        # A fresh tensor has standard strides, which view(uint8) needs (even for one element).
        bits = [torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1) for t in (got, want)]
        assert torch.equal(bits[0].view(torch.uint8), bits[1].view(torch.uint8)), where
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, where
        assert got.dtype == want.dtype.newbyteorder("<") and got.shape == want.shape, where
        assert got.flags.c_contiguous, where
        assert got.tobytes() == want.astype(got.dtype).tobytes(), where
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is (list if isinstance(want, list) else tuple), where
        assert len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{index}]")
    elif isinstance(want, float) and math.isnan(want):
        assert type(got) is float and math.isnan(got), where
    else:
        assert type(got) is type(want) and got == want, where


def roundtrip(obj: Any) -> Any:
    frame = encode(obj)
    assert frame.dtype == np.uint8 and frame.ndim == 1 and frame.flags.c_contiguous
    assert frame.size % 64 == 0 and frame.ctypes.data % 64 == 0
    return decode(frame)


def make_frame(
    header: bytes,
    body: bytes = b"",
    *,
    magic: bytes = b"EVFW",
    version: int = 1,
    flags: int = 0,
    reserved: int = 0,
    header_len: int | None = None,
    body_len: int | None = None,
) -> bytes:
    """A frame built by hand, possibly lying about its lengths."""
    hlen = len(header) if header_len is None else header_len
    blen = len(body) if body_len is None else body_len
    prefix = PREFIX.pack(magic, version, flags, reserved, hlen, blen)
    pad = -(len(prefix) + len(header)) % 64
    return prefix + header + bytes(pad) + body


def array_ext(code: int, dtype_code: int, offset: int, nbytes: int, shape: tuple[int, ...]) -> Any:
    desc = struct.pack(f"<BBQQ{len(shape)}Q", dtype_code, len(shape), offset, nbytes, *shape)
    return msgpack.ExtType(code, desc)


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        1.5,
        float("inf"),
        float("nan"),
        "",
        "héllo ✓",
        b"",
        b"abc",
        b"x" * 100_000,
        bytearray(b"ab"),
        bytearray(100_000),
    ],
)
def test_scalars_and_byte_strings_round_trip(value: Any) -> None:
    assert_same(roundtrip(value), value)


def test_nested_containers_keep_order_and_tuple_versus_list() -> None:
    obj = {
        "z": 1,
        "a": (1, (2, 3), [4, ()], {"t": (None,)}),
        "m": [(), [], {}, ((),), [[()]]],
        "k": [(0, 3, i) for i in range(3)],
    }
    got = roundtrip(obj)
    assert_same(got, obj)
    assert list(got) == ["z", "a", "m", "k"]
    assert_same(roundtrip((1, [2, (3,)])), (1, [2, (3,)]))
    assert_same(roundtrip([]), [])
    assert_same(roundtrip(()), ())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal(shape) * 100).astype(dtype)
    got = roundtrip({"x": arr, "after": 7})
    assert_same(got, {"x": arr, "after": 7})


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_tensors_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape, dtype=torch.float64) * 8).to(dtype)
    got = roundtrip([tensor, "after"])
    assert_same(got, [tensor, "after"])


def test_non_contiguous_and_byte_swapped_arrays_come_back_contiguous() -> None:
    base = np.arange(60, dtype=np.int64).reshape(3, 4, 5)
    cases = [base.transpose(2, 0, 1), base[:, ::2, ::-1], base[1, :, 2], np.broadcast_to(7, (3, 3))]
    cases.append(np.arange(6, dtype=">i4").reshape(2, 3))
    got = roundtrip(cases)
    for g, w in zip(got, cases, strict=True):
        assert_same(g, np.ascontiguousarray(w))
        assert g.dtype.byteorder in "<=|"


@pytest.mark.parametrize("dtype", [torch.int16, torch.bfloat16, torch.complex128], ids=str)
def test_empty_tensor_at_the_end_of_the_frame(dtype: torch.dtype) -> None:
    # The view of an empty buffer at the very end of a frame has a zero stride.
    for obj in (torch.empty(0, dtype=dtype), [1, torch.empty(0, 3, dtype=dtype)]):
        assert_same(roundtrip(obj), obj)


def test_non_contiguous_tensors_lose_grad_and_lazy_bits() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    grad = torch.ones(3, requires_grad=True) * 2
    cases = {
        "t": base.transpose(0, 2),
        "step": base[:, ::2],
        "expand": torch.ones(1, 3).expand(4, 3),
        "bf16": base.to(torch.bfloat16).permute(2, 1, 0),
        "grad": grad,
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "neg": torch.tensor([1 + 2j]).conj().imag,
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    got = roundtrip(cases)
    for key, want in cases.items():
        expected = want.detach().resolve_conj().resolve_neg().contiguous()
        assert_same(got[key], expected, key)
    assert torch.equal(got["conj"], torch.tensor([1 - 2j, 3 + 1j]))


def test_numpy_scalars_keep_their_dtype() -> None:
    scalars = [np.int32(-5), np.uint64(2**64 - 1), np.float16(1.5), np.bool_(True)]
    scalars += [np.complex64(1 - 2j), np.float64(0.25), np.int8(-128)]
    got = roundtrip(scalars)
    assert_same(got, scalars)
    assert roundtrip(np.str_("text")) == "text"
    assert type(roundtrip(np.str_("text"))) is str


def test_subclasses_travel_as_their_base_type() -> None:
    class Color(enum.IntEnum):
        RED = 3

    class Name(enum.StrEnum):
        A = "alpha"

    Point = namedtuple("Point", "x y")
    obj = OrderedDict(
        p=Point(1, [2]), c=Color.RED, n=Name.A, s=torch.Size([2, 3]), f=np.float64(2.5)
    )
    got = roundtrip(obj)
    assert_same(got, {"p": (1, [2]), "c": 3, "n": "alpha", "s": (2, 3), "f": np.float64(2.5)})


def test_memmap_arrays_are_sent_as_plain_arrays(tmp_path: Any) -> None:
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4, 2))
    mm[:] = 3.0
    assert_same(roundtrip({"m": mm})["m"], np.full((4, 2), 3.0, dtype=np.float32))


@pytest.mark.parametrize(
    "wrap", [bytes, bytearray, memoryview, np.array, torch.from_numpy], ids=lambda f: f.__name__
)
def test_decode_accepts_every_buffer_kind(wrap: Any) -> None:
    obj = {"a": np.arange(5), "t": torch.ones(2, 2), "b": b"q" * 9000}
    frame = encode(obj)
    buffer = wrap(frame.tobytes()) if wrap in (bytes, bytearray) else wrap(frame.copy())
    assert_same(decode(buffer), obj)


def test_padding_is_zeroed_so_no_stale_memory_leaves_the_rank() -> None:
    # np.empty recycles freed memory: fill some first, then check that every byte of the
    # frame that is neither prefix, header nor data is zero.
    for _ in range(3):
        np.full(1 << 16, 0xAB, dtype=np.uint8)
    frame = encode([np.ones(3, dtype=np.uint8), np.ones(5, dtype=np.uint8), b"z" * 8200])
    header_len, body_len = PREFIX.unpack_from(frame.tobytes())[4:]
    body = frame[-body_len:]
    assert not frame[20 + header_len : frame.size - body.size].any()
    assert body[:3].all() and not body[3:64].any()
    assert body[64:69].all() and not body[69:128].any()
    assert (body[128 : 128 + 8200] == ord("z")).all() and not body[128 + 8200 :].any()


# -- encode errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "path", "reason"),
    [
        ({"images": [1, 2, 3, {1, 2}]}, "['images'][3]", r"unsupported type set\.$"),
        ({"a": {1: "x"}}, "['a']", "dict key 1 has type int; only str keys"),
        ([0, (1, 2**64)], "[1][1]", "integer 18446744073709551616 is outside the 64-bit"),
        ({"n": -(2**63) - 1}, "['n']", "integer -9223372036854775809 is outside"),
        ({"c": 1j}, "['c']", "unsupported type complex"),
        ([object()], "[0]", "unsupported type object"),
        ({"f": frozenset()}, "['f']", "unsupported type frozenset"),
        ({"m": memoryview(b"a")}, "['m']", "unsupported type memoryview"),
        ({"e": msgpack.ExtType(3, b"")}, "['e']", "unsupported type ExtType"),
        ({"u": np.array(["a"])}, "['u']", "unsupported numpy dtype '<U1' \\(supported: bool"),
        ({"o": np.array([None], dtype=object)}, "['o']", "unsupported numpy dtype 'object'"),
        ({"s": np.zeros(2, dtype="i4,f4")}, "['s']", "unsupported numpy dtype"),
        ({"d": np.zeros(2, dtype="M8[s]")}, "['d']", "unsupported numpy dtype"),
        ({"q": torch.zeros(2, device="meta")}, "['q']", "tensor on device 'meta'; move it"),
        ({"sp": torch.eye(2).to_sparse()}, "['sp']", "tensor with layout torch.sparse_coo"),
        ({"x": "\ud800"}, "['x']", "str that is not valid UTF-8"),
        ({"\ud800": 1}, " key '\\ud800'", "str that is not valid UTF-8"),
        ({"ma": np.ma.masked_array([1, 2])}, "['ma']", "unsupported subclass MaskedArray"),
    ],
)
def test_encode_errors_name_the_path_and_the_type(obj: Any, path: str, reason: str) -> None:
    with pytest.raises(EncodeError, match=f"^{re.escape('obj' + path)}: {reason}") as info:
        encode(obj)
    assert isinstance(info.value, TypeError)
    with pytest.raises(EncodeError, match=f"^{re.escape('objs[1]' + path)}: {reason}"):
        encode_many([None, obj])


def test_cycles_and_deep_nesting_are_rejected() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(EncodeError, match="nesting deeper than"):
        encode({"loop": loop})
    deep: Any = 1
    for _ in range(300):
        deep = {"d": deep}
    with pytest.raises(EncodeError, match=r"^obj(\['d'\])+: nesting deeper than 256"):
        encode(deep)


def test_encode_many_rejects_a_single_object() -> None:
    with pytest.raises(TypeError, match="objs must be a sequence"):
        encode_many({"a": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="objs must be a sequence"):
        encode_many(b"abc")


# -- encode_many / decode_many -------------------------------------------------------------


def test_encode_many_writes_aligned_frames_back_to_back() -> None:
    objs: list[Any] = [{"r": r, "x": np.full(r * 10, r, dtype=np.int16)} for r in range(4)]
    objs.append(None)
    buffer, sizes = encode_many(objs)
    assert buffer.dtype == np.uint8 and buffer.size == sum(sizes) and len(sizes) == 5
    assert all(size % 64 == 0 for size in sizes)
    position = 0
    for obj, size in zip(objs, sizes, strict=True):
        frame = buffer[position : position + size]
        assert_same(decode(frame), obj)
        assert frame.tobytes() == encode(obj).tobytes()
        position += size
    got = decode_many(buffer, sizes)
    assert_same(got, objs)
    for item in got[1:4]:
        assert item["x"].ctypes.data % 64 == 0 and np.shares_memory(item["x"], buffer)


def test_encode_many_writes_into_a_reused_buffer_when_it_fits() -> None:
    objs: list[Any] = [{"x": np.arange(300, dtype=np.int32)}, (b"y" * 9000, "z")]
    fresh, sizes = encode_many(objs)
    out = np.full(fresh.size + 1000, 0xAB, dtype=np.uint8)  # stale bytes everywhere
    buffer, reused_sizes = encode_many(objs, out=out)
    assert reused_sizes == sizes
    assert buffer.size == fresh.size
    assert buffer.ctypes.data == out.ctypes.data  # out[:total], no new allocation
    # Every byte is written, padding included: nothing stale from the last use leaks.
    assert buffer.tobytes() == fresh.tobytes()
    assert_same(decode_many(buffer, sizes), objs)
    assert out[fresh.size :].tolist() == [0xAB] * 1000  # the rest is left alone


def test_encode_many_allocates_when_out_is_too_small() -> None:
    objs = [np.ones(1000, dtype=np.int64)]
    out = np.zeros(64, dtype=np.uint8)
    buffer, sizes = encode_many(objs, out=out)
    assert not np.shares_memory(buffer, out)
    assert buffer.size == sum(sizes) > out.size
    assert buffer.ctypes.data % 64 == 0
    assert out.tolist() == [0] * 64
    assert_same(decode_many(buffer, sizes), objs)
    # Growing: the larger buffer is reused by the next call.
    again, _ = encode_many([np.zeros(10, dtype=np.int64)], out=buffer)
    assert np.shares_memory(again, buffer)


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        (bytearray(128), TypeError, "out must be a 1-D uint8 numpy array or None"),
        (np.zeros(128, dtype=np.int8), TypeError, "dtype int8"),
        (np.zeros((2, 64), dtype=np.uint8), TypeError, r"shape \(2, 64\)"),
        (np.zeros(256, dtype=np.uint8)[::2], TypeError, "contiguous: False"),
        (np.frombuffer(bytes(128), dtype=np.uint8), ValueError, "out must be writable"),
    ],
)
def test_encode_many_rejects_a_bad_out(out: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        encode_many([1], out=out)


def test_encode_many_refuses_to_encode_out_into_itself() -> None:
    out = np.zeros(1 << 16, dtype=np.uint8)
    with pytest.raises(ValueError, match="out shares memory"):
        encode_many([{"x": out[-1000:]}], out=out)
    with pytest.raises(ValueError, match="out shares memory"):
        encode_many([torch.from_numpy(out[:100])], out=out)
    encode_many([out[-1000:].copy()], out=out)  # a copy is fine


def test_empty_inputs_and_zero_length_segments() -> None:
    buffer, sizes = encode_many([])
    assert buffer.size == 0 and buffer.dtype == np.uint8 and sizes == []
    assert decode_many(buffer, sizes) == []
    frame = encode([1])
    assert decode_many(np.concatenate([frame, frame]), [0, 64, 0, 64, 0]) == [
        None,
        [1],
        None,
        [1],
        None,
    ]
    assert decode(b"") is None
    assert decode_many(frame, np.array([64], dtype=np.int64)) == [[1]]
    assert decode_many(frame, torch.tensor([0, 64])) == [None, [1]]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([64], "add up to the buffer's 128 bytes"),
        ([64, 65], "add up"),
        ([-64, 192], "non-negative"),
        ([64.0, 64], "must be integers"),
        ([32, 96], "frame 0 of 2"),
    ],
)
def test_decode_many_rejects_bad_sizes(sizes: list[Any], message: str) -> None:
    buffer, _ = encode_many([1, 2])
    with pytest.raises(WireFormatError, match=message):
        decode_many(buffer, sizes)


def test_max_frame_bytes_limits_each_frame() -> None:
    frame = encode(np.zeros(1000, dtype=np.uint8))
    assert frame.size == 1088
    assert decode(frame, max_frame_bytes=1088).size == 1000
    with pytest.raises(WireFormatError, match="over max_frame_bytes=1024"):
        decode(frame, max_frame_bytes=1024)
    buffer, sizes = encode_many([1, np.zeros(1000, dtype=np.uint8)])
    with pytest.raises(WireFormatError, match=r"frame 1 of 2.*over max_frame_bytes"):
        decode_many(buffer, sizes, max_frame_bytes=1024)
    assert DEFAULT_MAX_FRAME_BYTES == 1 << 31
    for bad in (True, 1.5, "64"):
        with pytest.raises(TypeError, match="max_frame_bytes must be an int"):
            decode(frame, max_frame_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_frame_bytes must be at least 64"):
        decode(frame, max_frame_bytes=10)


@pytest.mark.parametrize(
    "buffer",
    [
        "text",
        np.zeros(64, dtype=np.int32),
        np.zeros(128, dtype=np.uint8)[::2],
        torch.zeros(64, dtype=torch.int32),
        [0] * 64,
    ],
    ids=["str", "int32-array", "strided", "int32-tensor", "list"],
)
def test_decode_rejects_buffers_of_the_wrong_kind(buffer: Any) -> None:
    with pytest.raises(TypeError, match="buffer must be"):
        decode(buffer)


# -- aliasing and copies -------------------------------------------------------------------


def test_numpy_results_are_views_of_the_receive_buffer() -> None:
    frame = encode({"a": np.arange(10, dtype=np.int32), "t": torch.arange(4)})
    writable = frame.copy()
    got = decode(writable)
    assert np.shares_memory(got["a"], writable) and got["a"].flags.writeable
    assert (got["a"].ctypes.data - writable.ctypes.data) % 64 == 0  # aligned within the frame
    assert decode(frame)["a"].ctypes.data % 64 == 0  # encode's output is aligned in memory
    writable_ptr = writable.ctypes.data
    assert writable_ptr <= got["t"].data_ptr() < writable_ptr + writable.size
    got["a"][0] = 99  # writing through the view changes the buffer: callers must copy
    assert decode(writable)["a"][0] == 99

    readonly = decode(frame.tobytes())
    assert not readonly["a"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        readonly["a"][0] = 1
    readonly["t"][0] = 5  # tensors from read-only buffers are private copies
    assert decode(frame)["t"][0] == 0


def test_tensor_receive_buffer_is_aliased_without_warnings() -> None:
    received = torch.from_numpy(encode({"t": torch.arange(6.0).reshape(2, 3)}).copy())
    got = decode(received)["t"]
    start = received.data_ptr()
    assert start <= got.data_ptr() < start + received.numel()
    readonly = received.numpy().data.toreadonly()
    assert decode(readonly)["t"].data_ptr() != got.data_ptr()


def test_decoding_a_large_frame_allocates_no_second_copy() -> None:
    frame = encode({"x": np.ones(4 << 20, dtype=np.int32)})  # 16 MiB
    tracemalloc.start()
    try:
        got = decode(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.shares_memory(got["x"], frame)
    assert peak < 1 << 20, peak


def test_encoding_copies_each_buffer_once_into_one_allocation() -> None:
    arrays = [np.ones(1 << 20, dtype=np.int32) for _ in range(4)]  # 16 MiB in all
    tracemalloc.start()
    try:
        buffer, _ = encode_many([{"a": arrays[:2]}, {"a": arrays[2:]}])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert buffer.size >= 16 << 20
    assert peak < buffer.size + (1 << 20), peak  # the output and nothing of similar size


def test_encoding_runs_at_memcpy_speed() -> None:
    # Relative, with a wide margin: the machines are noisy. benchmarks report real figures.
    arrays = [np.arange(1 << 20, dtype=np.int32) for _ in range(4)]
    flat = np.concatenate(arrays)

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def copy_into_fresh_buffer() -> None:
        np.copyto(np.empty_like(flat), flat)

    assert best(lambda: encode(arrays)) < 4 * best(copy_into_fresh_buffer) + 0.002


# -- hostile input -------------------------------------------------------------------------


def small_frame() -> bytes:
    return encode({"k": (1, 2), "a": np.arange(3, dtype=np.int16), "s": "x"}).tobytes()


def test_every_truncation_and_extension_is_rejected() -> None:
    frame = small_frame()
    for cut in range(1, len(frame)):
        with pytest.raises(WireFormatError):
            decode(frame[:cut])
    for extra in (b"\0", bytes(64)):
        with pytest.raises(WireFormatError, match="but has"):
            decode(frame + extra)


def test_random_bytes_and_bit_flips_never_escape_as_other_errors() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        junk = rng.randbytes(rng.choice([1, 19, 20, 64, 128, 500]))
        if rng.random() < 0.5:
            junk = PREFIX.pack(b"EVFW", 1, 0, 0, len(junk), 0) + junk
        with pytest.raises(WireFormatError):
            decode(junk)
    frame = bytearray(small_frame())
    for position in range(len(frame)):
        for bit in (0x01, 0x80):
            mutated = bytearray(frame)
            mutated[position] ^= bit
            with contextlib.suppress(WireFormatError):
                decode(mutated)  # may still be a valid frame (e.g. a changed number)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (make_frame(b"\xc0", magic=b"EVF\x00"), "instead of the magic"),
        (make_frame(b"\xc0", version=2), "format version 2"),
        (make_frame(b"\xc0", flags=1), "unknown flags"),
        (make_frame(b"\xc0", reserved=1), "reserved"),
        (make_frame(b"\xc0", header_len=2**32 - 1), "over max_frame_bytes"),
        (make_frame(b"\xc0", header_len=1000), "but has"),
        (make_frame(b"\xc0", body_len=2**62), "over max_frame_bytes"),
        (make_frame(b"\xc0", body_len=2**64 - 64), "over max_frame_bytes"),
        (make_frame(b"\xc0", body_len=64), "but has"),
        (make_frame(b"", header_len=0), "0-byte header"),
        (make_frame(b"\xc0", bytes(64)), "describes 0 body bytes but the body has 64"),
        (make_frame(b"\xc0", bytes(32), body_len=32), "32-byte body"),
        (make_frame(b"\xc1"), "not valid"),
        (make_frame(b"\xc0\xc0"), "not valid: ExtraData"),
        (make_frame(b"\x92\x01"), "not valid"),
        (make_frame(b"\x91" * 5000 + b"\xc0"), "not valid"),
        (make_frame(b"\xdd\xff\xff\xff\xff\xc0"), "not valid"),
        (make_frame(b"\xdf\xff\xff\xff\xff\xc0"), "not valid"),
        (make_frame(b"\xc6\xff\xff\xff\xff"), "not valid"),
        (make_frame(msgpack.packb({1: 2})), "not valid"),
        (make_frame(msgpack.packb({b"k": 2})), "dict key that is not a str"),
        (make_frame(msgpack.packb([msgpack.Timestamp(1)])), "timestamp"),
        (make_frame(msgpack.packb({"t": msgpack.Timestamp(1)})), "timestamp"),
        (make_frame(msgpack.packb(msgpack.Timestamp(1))), "timestamp"),
        (make_frame(msgpack.packb(msgpack.ExtType(9, b""))), "invalid extension"),
        (make_frame(msgpack.packb(msgpack.ExtType(3, b""))), "tuple marker outside"),
        (make_frame(msgpack.packb({"a": msgpack.ExtType(3, b"")})), "tuple marker outside"),
        (make_frame(msgpack.packb([1, msgpack.ExtType(3, b"")])), "tuple marker outside"),
        (make_frame(msgpack.packb(msgpack.ExtType(3, b"x"))), "invalid extension"),
        (make_frame(msgpack.packb(msgpack.ExtType(5, b"\x07\x00"))), "invalid extension"),
        (make_frame(msgpack.packb(msgpack.ExtType(5, b"\x63\x00"))), "invalid extension"),
        (make_frame(msgpack.packb(msgpack.ExtType(4, b"\x00"))), "invalid extension"),
    ],
)
def test_malformed_frames_are_rejected(frame: bytes, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode(frame)


def descriptor_frame(*exts: Any, body: bytes = bytes(64)) -> bytes:
    return make_frame(msgpack.packb(list(exts)), body)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (descriptor_frame(array_ext(1, 7, 0, 16, (4,)), body=bytes(128)), "describes 64"),
        (descriptor_frame(array_ext(1, 0, 0, 4, (4,))), "dtype code 0"),
        (descriptor_frame(array_ext(1, 99, 0, 4, (4,))), "dtype code 99"),
        (descriptor_frame(array_ext(1, 11, 0, 8, (4,))), "dtype code 11, not a numpy"),
        (descriptor_frame(array_ext(1, 7, 0, 12, (4,))), r"shape \(4,\) of int32"),
        (descriptor_frame(array_ext(1, 7, 0, 0, (2**62,))), "does not match"),
        (descriptor_frame(array_ext(1, 7, 0, 2**64 - 4, (2**62 - 1,))), "does not fit"),
        (descriptor_frame(array_ext(1, 7, 0, 0, (0, 2**62, 2**62))), "does not match"),
        (descriptor_frame(array_ext(2, 7, 0, 0, (0, 2**40, 2**40))), "does not match"),
        (descriptor_frame(array_ext(1, 7, 64, 4, (1,))), "at body offset 64"),
        (descriptor_frame(array_ext(1, 7, 2**62, 4, (1,))), "at body offset"),
        (descriptor_frame(array_ext(1, 7, 0, 128, (32,))), "does not fit"),
        (
            descriptor_frame(array_ext(1, 7, 0, 4, (1,)), array_ext(1, 7, 0, 4, (1,))),
            r"at body offset 0\).* the next buffer starts at 64",
        ),
        (descriptor_frame(msgpack.ExtType(1, b"\x07")), "wrong length"),
        (descriptor_frame(msgpack.ExtType(1, b"\x07\x41" + bytes(16))), "wrong length"),
        (descriptor_frame(msgpack.ExtType(2, b"\x07\x02" + bytes(24))), "wrong length"),
        (descriptor_frame(msgpack.ExtType(4, struct.pack("<BQQ", 2, 0, 1))), "invalid"),
        (descriptor_frame(msgpack.ExtType(4, struct.pack("<BQQ", 0, 0, 65))), "does not fit"),
    ],
)
def test_hostile_descriptors_are_rejected(frame: bytes, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode(frame)


def test_valid_hand_built_frame_decodes() -> None:
    # The same builder as the hostile cases, with a correct descriptor: proves they can pass.
    body = np.arange(4, dtype="<i4").tobytes() + bytes(48)
    got = decode(descriptor_frame(array_ext(1, 7, 0, 16, (2, 2)), body=body))
    assert_same(got, [np.arange(4, dtype=np.int32).reshape(2, 2)])


def test_absurd_declared_sizes_allocate_nothing_large() -> None:
    hostile = [
        make_frame(b"\xc0", body_len=2**62),
        make_frame(b"\xc0", header_len=2**31),
        descriptor_frame(array_ext(1, 7, 0, 2**40, (2**38,))),
        descriptor_frame(array_ext(2, 13, 0, 2**40, (2**37,))),
        make_frame(b"\xdd\x7f\xff\xff\xff"),
        make_frame(b"\xc6\x7f\xff\xff\xff"),
    ]
    tracemalloc.start()
    try:
        for frame in hostile:
            with pytest.raises(WireFormatError):
                decode(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_body_copies_cannot_exceed_the_input() -> None:
    # Two byte-string descriptors over the same region would double the copied bytes;
    # descriptors must tile the body in order, so the second one is refused.
    body = b"y" * 10_000
    body += bytes(-len(body) % 64)
    raw = msgpack.ExtType(4, struct.pack("<BQQ", 0, 0, 10_000))
    assert decode(descriptor_frame(raw, body=body)) == [b"y" * 10_000]
    with pytest.raises(WireFormatError, match="at body offset 0"):
        decode(descriptor_frame(raw, raw, body=body))
