"""The wire format: what crosses between ranks, encoded without pickle.

A *frame* is one encoded object::

    offset 0   prefix   struct "<4sBBHIQ": magic b"EVFW", format version, flags,
                        reserved (0), header length H, body length B
    offset 20  header   H bytes of msgpack: the object tree, with arrays, tensors, tuples,
                        large byte strings and numpy scalars replaced by ExtType descriptors
    offset S   body     B bytes of raw buffers, S = 20 + H rounded up to 64

Every raw buffer starts at a multiple of 64 inside the frame and ``B`` is a multiple of 64, so
a frame's length is a multiple of 64 and frames written back to back (:func:`encode_many`)
keep every buffer 64-byte aligned relative to the start of the whole buffer. :func:`encode`
returns a 64-byte aligned array, so its views are aligned in memory too. The padding bytes
are zero: no stale process memory leaves the rank.

**Values.** ``None``, ``bool``, ``int`` in ``[-2**63, 2**64)``, ``float``, ``str``, ``bytes``,
``bytearray``, ``dict`` with ``str`` keys (insertion order kept), ``list``, ``tuple`` (decoded
as ``tuple``), numpy arrays and torch CPU tensors of the dtypes in ``_DTYPES`` (any shape,
including 0-d and empty), and numpy scalars of those dtypes. Everything else raises
:class:`~evenflow.transports.errors.EncodeError` naming the value's path, e.g.
``obj['images'][3]: unsupported type set``. What comes back differs from what went in only
in these documented ways:

* numpy scalars come back as numpy scalars of the same dtype (``np.str_`` as ``str``);
* subclasses travel as their base type: ``OrderedDict`` → ``dict``, namedtuples and
  ``torch.Size`` → ``tuple``, ``IntEnum`` → ``int``, ``StrEnum`` → ``str``,
  ``np.memmap`` → ``np.ndarray``, ``nn.Parameter`` → ``Tensor``;
* non-contiguous arrays and tensors come back contiguous, in native (little-endian) byte
  order; tensors come back with ``requires_grad=False`` and no conjugate/negative bit;
* ``bytearray`` comes back as ``bytearray`` (a fresh copy), ``bytes`` as ``bytes``.

**Copies on encode.** Array, tensor, ``bytearray`` and large ``bytes`` data (at least
``_INLINE_BYTES_MAX`` bytes) is copied exactly once, straight into the output buffer: the
encoder packs the headers, measures every frame, allocates once (or reuses a buffer the
caller passes to :func:`encode_many`, which saves the page faults of fresh memory) and then
copies. Smaller ``bytes`` and all strings ride inside the msgpack header (copied into the
header, then the header into the frame), which is cheaper than a descriptor for small
values. Tensors with a lazy conjugate or negative bit are materialised first (one extra
copy). Nesting deeper than ``_MAX_DEPTH`` levels (or a cycle) is refused.

**Aliasing on decode.** Decoding never copies array data it does not have to:

* numpy arrays are views of the receive buffer, always. They are writable exactly when the
  buffer is (``bytes`` and read-only memoryviews give read-only arrays).
* torch tensors are views of the receive buffer when the buffer is writable (``bytearray``,
  writable memoryview, numpy array, torch tensor), and private copies when it is read-only,
  because torch cannot represent read-only memory. Empty tensors are always fresh.
* everything else (``bytes``, ``bytearray``, ``str``, numbers, numpy scalars) is a fresh
  object that owns its data.

So a caller that reuses or frees a writable receive buffer must copy the decoded arrays and
tensors it keeps first. Views keep the receive buffer alive (they hold a reference).

**Validation.** :func:`decode` treats its input as hostile. Before it unpacks anything it
checks the magic, the version, the flags, the declared lengths against the real length and
``max_frame_bytes``; it unpacks the header with msgpack limits derived from the header length
(``strict_map_key``, ``max_*_len``; msgpack refuses nesting deeper than 1024 levels and this
module never recurses while decoding); dict keys must be ``str``, msgpack timestamps and
unknown extension types are refused, a tuple marker may only open a list; every descriptor
must name an allowed dtype, have a shape whose product times the item size equals its
length, and sit exactly where the next buffer must start, so buffers never overlap, never
reach past the body and together cover it. Any violation raises
:class:`~evenflow.transports.errors.WireFormatError`. Decoding never executes anything from
the input; it allocates at most the header's decoded objects plus, for byte strings and
tensors from read-only input, copies whose total is bounded by the body's size. An empty
buffer (a rank that sent nothing) decodes to ``None``.

**Two decoders, one result.** Each frame is first offered to a compiled decoder
(``_wirec.c``; :func:`decode_many` hands it every frame at once), which
builds the common case (containers, numbers, strings, byte strings, arrays and tensors) about
four times faster, and declines anything it does not build itself or that is not plainly
valid (numpy scalars, any malformed or hostile prefix or header). A declined frame (for
``decode_many``: any declined frame) goes through the checked path above, which decodes it
or says exactly what is wrong. Tests hold the two to equal results on generated and on
corrupted frames.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Iterable, Sequence
from typing import Any, Final, NamedTuple, SupportsIndex

import msgpack
import numpy as np
import numpy.typing as npt
import torch

from evenflow.transports._wirec import configure as _configure_compiled
from evenflow.transports._wirec import decode_many as _decode_many_compiled
from evenflow.transports.errors import EncodeError, WireFormatError

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "decode", "decode_many", "encode", "encode_many"]

#: The largest frame :func:`decode` accepts unless told otherwise (2 GiB).
DEFAULT_MAX_FRAME_BYTES: Final = 1 << 31

_MAGIC: Final = b"EVFW"
_VERSION: Final = 1
#: No flag is defined in version 1; the byte is there for later versions (compression...).
_KNOWN_FLAGS: Final = 0
_PREFIX: Final = struct.Struct("<4sBBHIQ")  # magic, version, flags, reserved, H, B
_ALIGN: Final = 64
_ZEROS: Final = bytes(_ALIGN)
_MAX_HEADER: Final = (1 << 32) - 1

#: ``bytes`` shorter than this ride inside the header; longer ones go to the body.
_INLINE_BYTES_MAX: Final = 8192
#: Encode-side nesting limit, far from Python's recursion limit. The decoder does not
#: recurse; msgpack's unpacker refuses nesting deeper than 1024 levels.
_MAX_DEPTH: Final = 256
_MAX_NDIM: Final = 64
#: Bound on the product of an array's non-zero dimensions, so that a hostile empty shape
#: such as (0, 2**62, 2**62) cannot overflow numpy's or torch's stride arithmetic.
_MAX_EXTENT: Final = 1 << 48

_EXT_NDARRAY: Final = 1
_EXT_TENSOR: Final = 2
_EXT_TUPLE: Final = 3
_EXT_RAW: Final = 4
_EXT_SCALAR: Final = 5
_RAW_BYTES: Final = 0
_RAW_BYTEARRAY: Final = 1
# Descriptors, little-endian. Arrays and tensors: dtype code, ndim, offset, nbytes, shape.
# Byte strings: kind, offset, nbytes. Numpy scalars: dtype code, then the value's bytes.
_ARRAY_DESC: Final = [struct.Struct(f"<BBQQ{n}Q") for n in range(_MAX_NDIM + 1)]
_RAW_DESC: Final = struct.Struct("<BQQ")
#: Array descriptor length -> (ndim, struct): the length alone says how many dimensions.
_ARRAY_LAYOUTS: Final = {desc.size: (ndim, desc) for ndim, desc in enumerate(_ARRAY_DESC)}
_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType.__new__ re-validates its arguments in Python, which costs more than the rest of
    # a small array's encoding; these arguments are valid by construction.
    ext: msgpack.ExtType = tuple.__new__(msgpack.ExtType, (code, data))
    return ext


_TUPLE_MARK: Final = _ext(_EXT_TUPLE, b"")


class _DType(NamedTuple):
    code: int
    name: str
    itemsize: int
    #: How the bytes look to numpy: the dtype itself, or a same-size unsigned integer for
    #: dtypes numpy lacks (bfloat16, float8). Always little-endian.
    carrier: np.dtype[Any]
    numpy: bool
    torch: torch.dtype | None
    #: torch dtype to ``.view()`` a tensor as before ``.numpy()``.
    torch_carrier: torch.dtype | None


def _build_dtypes() -> dict[int, _DType]:
    # Codes are part of the wire format: never renumber, only append.
    table = [
        (1, "bool", "bool"),
        (2, "uint8", "uint8"),
        (3, "int8", "int8"),
        (4, "uint16", "uint16"),
        (5, "int16", "int16"),
        (6, "uint32", "uint32"),
        (7, "int32", "int32"),
        (8, "uint64", "uint64"),
        (9, "int64", "int64"),
        (10, "float16", "float16"),
        (11, "bfloat16", "uint16"),
        (12, "float32", "float32"),
        (13, "float64", "float64"),
        (14, "complex64", "complex64"),
        (15, "complex128", "complex128"),
        (16, "float8_e4m3fn", "uint8"),
        (17, "float8_e5m2", "uint8"),
        (18, "float8_e4m3fnuz", "uint8"),
        (19, "float8_e5m2fnuz", "uint8"),
        (20, "float8_e8m0fnu", "uint8"),
    ]
    out: dict[int, _DType] = {}
    for code, name, carrier_name in table:
        carrier = np.dtype(carrier_name).newbyteorder("<")
        found = getattr(torch, name, None)  # float8 variants depend on the torch build
        tdtype = found if isinstance(found, torch.dtype) else None
        tcarrier = getattr(torch, carrier_name) if tdtype is not None else None
        out[code] = _DType(
            code, name, carrier.itemsize, carrier, name == carrier_name, tdtype, tcarrier
        )
    return out


_DTYPES: Final = _build_dtypes()
_NP_SPECS: Final = {d.carrier: d for d in _DTYPES.values() if d.numpy}
_TORCH_SPECS: Final = {d.torch: d for d in _DTYPES.values() if d.torch is not None}
_STR: Final = frozenset({str})
_PLAIN: Final = frozenset({str, int, float, bool, type(None)})
#: Types ``_prepare`` leaves to the ``default`` hook without a closer look.
_LEAVES: Final = _PLAIN | {np.ndarray, torch.Tensor}
#: msgpack packs these natively, so they would slip past the ``default`` hook.
_NATIVE_FOREIGN: Final = (msgpack.ExtType, msgpack.Timestamp, memoryview)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def _names(specs: Any) -> str:
    return ", ".join(sorted(d.name for d in specs))


class _Unsupported(Exception):
    """A value the format cannot carry; ``path`` collects keys innermost-first."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path: list[str] = []


class _Raw:
    """Marks a byte string that travels in the body instead of the header."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data


# -- encoding --------------------------------------------------------------------------------


def _prepare(value: Any, depth: int) -> Any:
    """Check containers and keys and wrap body-bound byte strings, copying as little as possible.

    Returns ``value`` itself unless something inside had to be replaced; then only the
    containers on the way to the replacement are shallow-copied. Other leaves (arrays,
    tensors, numpy scalars, out-of-range ints, unsupported types) reach the msgpack
    ``default`` hook, which sees exactly the values msgpack cannot pack itself.
    """
    t = type(value)
    if t in _LEAVES:
        return value
    if depth > _MAX_DEPTH:
        raise _Unsupported(f"nesting deeper than {_MAX_DEPTH} levels (is there a cycle?)")
    if t is dict:
        # Fast path in C: all keys exact str and all values leaves (a typical sample).
        if _STR.issuperset(map(type, value)) and _LEAVES.issuperset(map(type, value.values())):
            return value
        out: dict[str, Any] | None = None
        for key, item in value.items():
            if type(key) is not str and not isinstance(key, str):
                raise _Unsupported(
                    f"dict key {key!r} has type {type(key).__name__}; only str keys are supported"
                )
            if type(item) in _LEAVES:
                continue
            try:
                new = _prepare(item, depth + 1)
            except _Unsupported as exc:
                exc.path.append(f"[{key!r}]")
                raise
            if new is not item:
                if out is None:
                    out = dict(value)
                out[key] = new
        return value if out is None else out
    if t is list or t is tuple:
        if _LEAVES.issuperset(map(type, value)):
            return value
        changed: list[Any] | None = None
        for index, item in enumerate(value):
            if type(item) in _LEAVES:
                continue
            try:
                new = _prepare(item, depth + 1)
            except _Unsupported as exc:
                exc.path.append(f"[{index}]")
                raise
            if new is not item:
                if changed is None:
                    changed = list(value)
                changed[index] = new
        if changed is None:
            return value
        return changed if t is list else tuple(changed)
    if t is bytes:
        return _Raw(value) if len(value) >= _INLINE_BYTES_MAX else value
    if t is bytearray:
        return _Raw(value)
    if isinstance(value, _NATIVE_FOREIGN):
        raise _Unsupported(f"unsupported type {t.__qualname__}")
    # Subclasses travel as their base type (numpy scalars are handled by the hook).
    if isinstance(value, np.generic):
        return value
    if isinstance(value, dict):
        return _prepare(dict(value), depth)
    if isinstance(value, list):
        return _prepare(list(value), depth)
    if isinstance(value, tuple):
        return _prepare(tuple(value), depth)
    if isinstance(value, (bytes, bytearray)):
        return _prepare(bytes(value), depth)
    return value


class _FrameBuilder:
    """Packs one frame's header with msgpack and lays out its body, without copying data.

    Everything about the frame except the data itself is settled here: its size, its first
    bytes (prefix, header and padding: ``head``, one copy when written) and where each
    buffer goes. ``write`` then only copies.
    """

    __slots__ = ("cursor", "head", "header_len", "pending", "size")

    def __init__(self, obj: Any) -> None:
        self.cursor = 0  # body bytes reserved so far, always a multiple of _ALIGN
        # (offset in the body, nbytes, source), in body order; sources are numpy arrays or
        # byte strings.
        self.pending: list[tuple[int, int, Any]] = []
        packer = msgpack.Packer(default=self.default, use_bin_type=True, strict_types=True)
        header = packer.pack(_prepare(obj, 0))
        self.header_len = len(header)
        header_end = _PREFIX.size + self.header_len
        body_start = _align(header_end)
        self.size = body_start + self.cursor
        if self.header_len > _MAX_HEADER:
            self.head = b""  # _build refuses it; nothing is ever written
            return
        self.head = b"".join(
            (
                _PREFIX.pack(_MAGIC, _VERSION, 0, 0, self.header_len, self.cursor),
                header,
                _ZEROS[: body_start - header_end],
            )
        )

    def _reserve(self, source: Any, nbytes: int) -> int:
        offset = self.cursor
        self.cursor = _align(offset + nbytes)
        self.pending.append((offset, nbytes, source))
        return offset

    def default(self, obj: Any) -> Any:
        """Translate a value msgpack cannot pack; raise ``_Unsupported`` for the rest."""
        t = type(obj)
        if t is tuple:
            return [_TUPLE_MARK, *obj]
        if t is np.ndarray or t is np.memmap:
            return self._ndarray(obj)
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._tensor(obj)
        if t is _Raw:
            data = obj.data
            kind = _RAW_BYTEARRAY if type(data) is bytearray else _RAW_BYTES
            offset = self._reserve(data, len(data))
            return _ext(_EXT_RAW, _RAW_DESC.pack(kind, offset, len(data)))
        if isinstance(obj, np.generic):
            return self._scalar(obj)
        if isinstance(obj, (np.ndarray, torch.Tensor)):
            raise _Unsupported(
                f"unsupported subclass {t.__qualname__}; pass a plain array or tensor"
            )
        if isinstance(obj, int) and not isinstance(obj, bool):
            # Exact ints reach this hook only when they do not fit in 64 bits.
            value = int(obj)
            if not _INT_MIN <= value <= _INT_MAX:
                raise _Unsupported(
                    f"integer {value} is outside the 64-bit range [-2**63, 2**64); send it as a str"
                )
            return value
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        raise _Unsupported(f"unsupported type {t.__qualname__}")

    def _ndarray(self, arr: npt.NDArray[Any]) -> msgpack.ExtType:
        spec = _NP_SPECS.get(arr.dtype)
        if spec is None and arr.dtype.byteorder == ">":
            spec = _NP_SPECS.get(arr.dtype.newbyteorder("<"))
        if spec is None:
            raise _Unsupported(
                f"unsupported numpy dtype {str(arr.dtype)!r} (supported: "
                f"{_names(_NP_SPECS.values())})"
            )
        return self._array(_EXT_NDARRAY, spec, arr, arr.shape)

    def _tensor(self, tensor: torch.Tensor) -> msgpack.ExtType:
        if tensor.device.type != "cpu":
            raise _Unsupported(
                f"tensor on device {str(tensor.device)!r}; move it to the CPU first (tensor.cpu())"
            )
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            raise _Unsupported(
                f"tensor with layout {tensor.layout} (quantized={tensor.is_quantized}, "
                f"nested={tensor.is_nested}); only dense tensors are supported"
            )
        spec = _TORCH_SPECS.get(tensor.dtype)
        if spec is None:
            raise _Unsupported(
                f"unsupported tensor dtype {tensor.dtype} (supported: "
                f"{_names(_TORCH_SPECS.values())})"
            )
        # Copy through numpy: numpy copies on the calling thread, whereas torch's parallel
        # copy_ was measured 15x slower on oversubscribed CPUs. Lazy conjugate/negative bits
        # have to be materialised first (an extra copy for those rare tensors).
        source = tensor.detach().resolve_conj().resolve_neg()
        if spec.torch_carrier is not None and spec.torch_carrier is not spec.torch:
            source = source.view(spec.torch_carrier)
        return self._array(_EXT_TENSOR, spec, source.numpy(), tuple(tensor.shape))

    def _array(
        self, code: int, spec: _DType, arr: npt.NDArray[Any], shape: tuple[int, ...]
    ) -> msgpack.ExtType:
        ndim = len(shape)
        if ndim > _MAX_NDIM:
            raise _Unsupported(f"{ndim} dimensions (at most {_MAX_NDIM} are supported)")
        nbytes = arr.size * spec.itemsize
        offset = self._reserve(arr, nbytes)
        return _ext(code, _ARRAY_DESC[ndim].pack(spec.code, ndim, offset, nbytes, *shape))

    def _scalar(self, scalar: np.generic) -> Any:
        if isinstance(scalar, np.str_):
            return str.__str__(scalar)
        spec = _NP_SPECS.get(scalar.dtype)
        if spec is None:
            raise _Unsupported(f"unsupported numpy scalar of dtype {str(scalar.dtype)!r}")
        data = np.asarray(scalar, dtype=spec.carrier).tobytes()
        return _ext(_EXT_SCALAR, bytes((spec.code,)) + data)

    def write(self, frame: memoryview) -> None:
        """Write the frame into ``frame`` (exactly ``size`` bytes), copying each buffer once.

        Padding is written as zeros: nothing stale from a reused buffer leaves the rank."""
        base = end = len(self.head)
        frame[:end] = self.head
        for offset, nbytes, source in self.pending:
            if not nbytes:
                continue
            start = base + offset
            if start != end:
                frame[end:start] = _ZEROS[: start - end]
            end = start + nbytes
            if type(source) is bytes or type(source) is bytearray:
                frame[start:end] = source
            elif source.flags.c_contiguous and source.dtype.isnative:
                frame[start:end] = source.data.cast("B")
            else:  # strided or byte-swapped: numpy gathers it in one pass
                target = np.frombuffer(
                    frame, source.dtype.newbyteorder("="), source.size, start
                ).reshape(source.shape)
                np.copyto(target, source, casting="equiv")
        if end != self.size:
            frame[end:] = _ZEROS[: self.size - end]


def _locate(value: Any, path: str, depth: int = 0) -> tuple[str, str] | None:
    """Find the first value the encoder rejects as ``(path, reason)``. Runs on errors only."""
    if type(value) is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, f"str that is not valid UTF-8 ({exc.reason})"
        return None
    try:
        prepared = _prepare(value, depth)
    except _Unsupported as exc:
        return path + "".join(reversed(exc.path)), exc.reason
    t = type(prepared)
    if t is dict:
        for key, item in prepared.items():
            found = _locate(key, f"{path} key {key!r}", depth + 1) or _locate(
                item, f"{path}[{key!r}]", depth + 1
            )
            if found:
                return found
    elif t is list or t is tuple:
        for index, item in enumerate(prepared):
            found = _locate(item, f"{path}[{index}]", depth + 1)
            if found:
                return found
    elif (t is not _Raw and t not in _PLAIN) or t is int:
        try:
            _FrameBuilder(prepared)  # packs just this leaf: the hook judges it
        except _Unsupported as exc:
            return path, exc.reason
    return None


def _build(obj: Any, path: str) -> _FrameBuilder:
    try:
        builder = _FrameBuilder(obj)
    except _Unsupported as exc:
        if exc.path:  # raised by _prepare, which knows where
            raise EncodeError(f"{path}{''.join(reversed(exc.path))}: {exc.reason}.") from None
        where, reason = _locate(obj, path) or (path, exc.reason)
        raise EncodeError(f"{where}: {reason}.") from None
    except (ValueError, TypeError, OverflowError) as exc:  # msgpack's own refusals
        where, reason = _locate(obj, path) or (path, f"msgpack refused it ({exc})")
        raise EncodeError(f"{where}: {reason}.") from exc
    if builder.header_len > _MAX_HEADER:
        raise EncodeError(
            f"{path}: the encoded header has {builder.header_len} bytes, over the limit of "
            f"{_MAX_HEADER}; send bulk text or numbers as arrays."
        )
    return builder


def _aligned_empty(nbytes: int) -> npt.NDArray[np.uint8]:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]


class _PendingFrames:
    """Frames whose headers are packed and sizes known, with their data not yet copied.

    :func:`encode_many` in two steps, for callers that announce the sizes before paying for
    the copy (the Gloo transport overlaps the copy with its size exchange). Everything that
    can reject the input (``EncodeError``, a bad ``out``) happens in the constructor and in
    :meth:`buffer`; :meth:`write` only copies, so it fails only if a source changed size in
    between (a byte string mutated by another thread).
    """

    __slots__ = ("builders", "sizes", "total")

    def __init__(self, objs: Sequence[Any]) -> None:
        if isinstance(objs, (str, bytes, bytearray)) or not isinstance(objs, Sequence):
            raise TypeError(
                f"objs must be a sequence with one object per frame, but got "
                f"{type(objs).__name__}; wrap a single object in a list or call encode()."
            )
        self.builders = [_build(obj, f"objs[{index}]") for index, obj in enumerate(objs)]
        self.sizes = [builder.size for builder in self.builders]
        self.total = sum(self.sizes)

    def buffer(self, out: npt.NDArray[np.uint8] | None) -> npt.NDArray[np.uint8]:
        """Where the frames go: ``out[:total]`` when they fit, else a new aligned buffer."""
        if out is None:
            return _aligned_empty(self.total)
        if not isinstance(out, np.ndarray):
            raise TypeError(
                f"out must be a 1-D uint8 numpy array or None, but got {type(out).__name__}; "
                f"pass the buffer a previous encode_many() returned, or None."
            )
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
            raise TypeError(
                f"out must be a 1-D C-contiguous uint8 numpy array, but got dtype {out.dtype}, "
                f"shape {out.shape} (contiguous: {out.flags.c_contiguous}); pass "
                f"np.empty(n, dtype=np.uint8)."
            )
        if not out.flags.writeable:
            raise ValueError(
                "out must be writable, but got a read-only array; pass a writable one."
            )
        if self.total > out.size:
            return _aligned_empty(self.total)
        # Copying a source into memory it occupies would corrupt it mid-copy. Byte strings
        # own their memory; arrays (tensors are held as numpy views) are checked by range.
        for builder in self.builders:
            for _, _, source in builder.pending:
                owned = type(source) is bytes or type(source) is bytearray
                if not owned and np.may_share_memory(source, out):
                    raise ValueError(
                        "out shares memory with an array or tensor being encoded; encode "
                        "into a different buffer (or pass out=None)."
                    )
        return out[: self.total]

    def write(self, buffer: npt.NDArray[np.uint8]) -> None:
        """Copy every frame into ``buffer`` (from :meth:`buffer`), back to back."""
        view = buffer.data
        position = 0
        for builder, size in zip(self.builders, self.sizes, strict=True):
            builder.write(view[position : position + size])
            position += size


def encode_many(
    objs: Sequence[Any], *, out: npt.NDArray[np.uint8] | None = None
) -> tuple[npt.NDArray[np.uint8], list[int]]:
    """Encode each object as one frame, back to back in one contiguous uint8 buffer.

    Returns the buffer and each frame's length in bytes. Lengths are multiples of 64, so
    every frame, and every raw buffer inside it, starts 64-byte aligned. All headers are
    packed and all frames measured first; then each array, tensor or body-bound byte string
    is copied exactly once into the buffer. An empty ``objs`` gives an empty buffer and no
    lengths. Raises :class:`~evenflow.transports.errors.EncodeError` naming the first value
    the format cannot carry, e.g. ``objs[2]['images'][3]: unsupported type set.``

    ``out`` (a 1-D, C-contiguous, writable uint8 array) lets a caller reuse one buffer
    across calls: when the frames fit, they are written into its start and the result is
    ``out[:total]``, a view; when they do not, a new 64-byte aligned buffer is allocated as
    without ``out`` (``np.shares_memory(result, out)`` tells which happened), so a caller
    keeping the larger of the two gets a grow-only buffer. Every byte of the result is
    written, padding included: nothing stale from an earlier use leaves the rank. The caller
    must not read the previous contents of ``out`` after this call, and no array or tensor
    in ``objs`` may share memory with ``out`` (``ValueError``).
    """
    frames = _PendingFrames(objs)
    buffer = frames.buffer(out)
    frames.write(buffer)
    return buffer, frames.sizes


def encode(obj: Any) -> npt.NDArray[np.uint8]:
    """Encode ``obj`` as one frame: a contiguous, 64-byte aligned, 1-D uint8 numpy array.

    ``torch.from_numpy(encode(obj))`` shares its memory. The module docstring lists the
    supported values and what changes on the way. Raises
    :class:`~evenflow.transports.errors.EncodeError` naming the path of the first value the
    format cannot carry, e.g. ``obj['images'][3]: unsupported type set.``
    """
    builder = _build(obj, "obj")
    out = _aligned_empty(builder.size)
    builder.write(out.data)
    return out


# -- decoding --------------------------------------------------------------------------------


class _TupleMark:
    """What the tuple marker decodes to; only valid as the first item of a list."""

    __slots__ = ()


_TUPLE: Final = _TupleMark()
_TIMESTAMP: Final = msgpack.Timestamp


def _foreign_timestamp() -> WireFormatError:
    return WireFormatError("frame header holds a msgpack timestamp, which this format never uses.")


class _FrameReader:
    """Checks descriptors and builds views while msgpack unpacks one frame's header."""

    __slots__ = ("base", "body_len", "cursor", "marks", "tuples", "view")

    def __init__(self, view: memoryview, base: int, body_len: int) -> None:
        self.view = view  # the whole frame
        self.base = base  # where the body starts in the frame
        self.body_len = body_len
        # Body offset where the next buffer must start. Buffers must follow each other in
        # document order at aligned offsets: no gaps and no overlap, so all views and copies
        # together never exceed the body.
        self.cursor = 0
        self.marks = 0
        self.tuples = 0

    def list_hook(self, items: list[Any]) -> Any:
        if _TIMESTAMP in map(type, items):
            raise _foreign_timestamp()
        if items and items[0] is _TUPLE:
            self.tuples += 1
            return tuple(items[1:])
        return items

    @staticmethod
    def object_hook(items: dict[Any, Any]) -> dict[str, Any]:
        # strict_map_key still lets bytes keys through; msgpack turns ext type -1 into
        # Timestamp objects without asking ext_hook. Neither is a value this format carries.
        if not _STR.issuperset(map(type, items)):
            raise WireFormatError("frame header holds a dict key that is not a str.")
        if _TIMESTAMP in map(type, items.values()):
            raise _foreign_timestamp()
        return items

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code in (_EXT_NDARRAY, _EXT_TENSOR):
            return self._array(code, data)
        if code == _EXT_TUPLE and not data:
            self.marks += 1
            return _TUPLE
        if code == _EXT_RAW and len(data) == _RAW_DESC.size:
            kind, offset, nbytes = _RAW_DESC.unpack(data)
            if kind in (_RAW_BYTES, _RAW_BYTEARRAY):
                start = self._claim(offset, nbytes)
                window = self.view[start : start + nbytes]
                return window.tobytes() if kind == _RAW_BYTES else bytearray(window)
        elif code == _EXT_SCALAR and data:
            spec = _DTYPES.get(data[0])
            if spec is not None and spec.numpy and len(data) == 1 + spec.itemsize:
                return np.frombuffer(data, spec.carrier, 1, 1)[0]
        raise WireFormatError(f"header holds an invalid extension (type {code}, {data[:24]!r}).")

    def _claim(self, offset: int, nbytes: int) -> int:
        if offset != self.cursor or nbytes > self.body_len - offset:
            raise WireFormatError(
                f"buffer descriptor ({nbytes} bytes at body offset {offset}) does not fit: "
                f"the next buffer starts at {self.cursor} of a {self.body_len}-byte body."
            )
        self.cursor = _align(offset + nbytes)
        return self.base + offset

    def _array(self, code: int, data: bytes) -> Any:
        # The hot path of decoding (every array of every sample): checks in the cheapest
        # order, one struct call, no generator unless the array is empty.
        layout = _ARRAY_LAYOUTS.get(len(data))
        if layout is None or data[1] != layout[0]:
            raise WireFormatError(f"array descriptor {data[:24]!r} has the wrong length.")
        ndim, desc = layout
        dtype_code, _, offset, nbytes, *shape = desc.unpack(data)
        spec = _DTYPES.get(dtype_code)
        if spec is None or not (spec.numpy if code == _EXT_NDARRAY else spec.torch):
            kind = "numpy array" if code == _EXT_NDARRAY else "tensor (in this torch build)"
            raise WireFormatError(f"array descriptor names dtype code {dtype_code}, not a {kind}.")
        count = shape[0] if ndim == 1 else math.prod(shape)
        if count * spec.itemsize != nbytes or (
            not count and math.prod(dim for dim in shape if dim) > _MAX_EXTENT
        ):
            raise WireFormatError(
                f"array descriptor shape {tuple(shape)} of {spec.name} does not match its "
                f"{nbytes} bytes."
            )
        if offset != self.cursor or nbytes > self.body_len - offset:
            self._claim(offset, nbytes)  # raises
        self.cursor = (offset + nbytes + _ALIGN - 1) & ~(_ALIGN - 1)
        start = self.base + offset
        if code == _EXT_NDARRAY:
            array = np.frombuffer(self.view, spec.carrier, count, start)
            return array if ndim == 1 else array.reshape(shape)
        return _tensor_at(self.view, spec.code, start, nbytes, shape)


def _tensor_at(
    view: memoryview, dtype_code: int, start: int, nbytes: int, shape: Sequence[int]
) -> torch.Tensor:
    """The tensor whose checked descriptor says it lies at ``view[start:start + nbytes]``."""
    dtype = _DTYPES[dtype_code].torch
    assert dtype is not None  # the descriptor was checked against the torch build
    if not nbytes:  # an empty view can carry a zero stride that view(dtype) refuses
        return torch.empty(shape, dtype=dtype)
    raw = np.frombuffer(view, np.uint8, nbytes, start)
    # torch cannot mark memory read-only (from_numpy warns), so read-only input is copied.
    tensor = torch.from_numpy(raw.copy() if view.readonly else raw)
    return tensor.view(dtype).view(shape)


_configure_compiled(
    [(d.code, d.itemsize, d.carrier, d.numpy, d.torch is not None) for d in _DTYPES.values()],
    np.frombuffer,
    _tensor_at,
)


def check_max_frame_bytes(max_frame_bytes: object) -> int:
    """``max_frame_bytes`` validated: the one check of that value (decoders and transports)."""
    if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int):
        raise TypeError(
            f"max_frame_bytes must be an int, but got {max_frame_bytes!r} "
            f"({type(max_frame_bytes).__name__}); pass a number of bytes >= {_ALIGN}, e.g. "
            f"the default {DEFAULT_MAX_FRAME_BYTES}."
        )
    if max_frame_bytes < _ALIGN:
        raise ValueError(
            f"max_frame_bytes must be at least {_ALIGN} (the smallest frame), "
            f"but got {max_frame_bytes!r}; the default is {DEFAULT_MAX_FRAME_BYTES}."
        )
    return max_frame_bytes


def _as_view(buffer: Any) -> memoryview:
    """A flat byte memoryview of ``buffer``, without copying."""
    if isinstance(buffer, np.ndarray):
        if buffer.dtype != np.uint8 or not buffer.flags.c_contiguous:
            raise TypeError(
                f"buffer must be a C-contiguous uint8 array, but got dtype {buffer.dtype} "
                f"(contiguous: {buffer.flags.c_contiguous}); pass np.ascontiguousarray(...)."
            )
        return buffer.reshape(-1).data
    if isinstance(buffer, torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu":
            raise TypeError(
                f"buffer must be a uint8 CPU tensor, but got dtype {buffer.dtype} on device "
                f"{str(buffer.device)!r}; move it with tensor.cpu() first."
            )
        if not buffer.is_contiguous():
            raise TypeError("buffer must be a contiguous tensor; pass tensor.contiguous().")
        array: npt.NDArray[np.uint8] = buffer.detach().reshape(-1).numpy()
        return array.data
    if isinstance(buffer, (bytes, bytearray, memoryview)):
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise TypeError("buffer must be a C-contiguous memoryview; pass bytes(buffer).")
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    raise TypeError(
        f"buffer must be bytes, bytearray, a memoryview, a uint8 numpy array or a uint8 CPU "
        f"tensor, but got {type(buffer).__name__}."
    )


def _decode_frame(view: memoryview, max_frame_bytes: int, *, fast: bool = True) -> Any:
    """One frame's object. ``fast=False`` skips the compiled decoder (tests compare the two)."""
    size = len(view)
    if size < _PREFIX.size:
        raise WireFormatError(
            f"frame of {size} bytes is truncated: its fixed prefix alone has {_PREFIX.size}."
        )
    magic, version, flags, reserved, header_len, body_len = _PREFIX.unpack_from(view)
    if magic != _MAGIC:
        raise WireFormatError(f"frame starts with {magic!r} instead of the magic {_MAGIC!r}.")
    if version != _VERSION:
        raise WireFormatError(f"frame has format version {version}; this reads {_VERSION}.")
    if flags & ~_KNOWN_FLAGS or reserved:
        raise WireFormatError(f"frame has unknown flags {flags:#x} or reserved bits {reserved}.")
    base = _align(_PREFIX.size + header_len)
    if base + body_len > max_frame_bytes:
        raise WireFormatError(
            f"frame declares {base + body_len} bytes, over max_frame_bytes={max_frame_bytes}."
        )
    if base + body_len != size or not header_len or body_len % _ALIGN:
        raise WireFormatError(
            f"frame declares a {header_len}-byte header and a {body_len}-byte body "
            f"({base + body_len} bytes with padding) but has {size} bytes."
        )
    if fast:
        decoded = _decode_many_compiled(view, [size], max_frame_bytes)
        if decoded is not NotImplemented:
            return decoded[0]
    # The checked path: every frame the compiled decoder declines, which includes every
    # invalid one, so that the error says exactly what is wrong.
    reader = _FrameReader(view, base, body_len)
    try:
        # Every msgpack element takes at least one header byte, so header_len bounds every
        # length; the C unpacker refuses nesting deeper than 1024 levels.
        obj = msgpack.unpackb(
            view[_PREFIX.size : _PREFIX.size + header_len],
            raw=False,
            strict_map_key=True,
            ext_hook=reader.ext_hook,
            list_hook=reader.list_hook,
            object_hook=reader.object_hook,
            max_str_len=header_len,
            max_bin_len=header_len,
            max_array_len=header_len,
            max_map_len=header_len,
            max_ext_len=header_len,
        )
    except WireFormatError:
        raise
    except Exception as exc:  # msgpack signals corruption with several exception types
        raise WireFormatError(f"frame header is not valid: {type(exc).__name__}: {exc}") from exc
    if type(obj) is _TIMESTAMP:
        raise _foreign_timestamp()
    if reader.marks != reader.tuples:
        raise WireFormatError("frame header holds a tuple marker outside a tuple.")
    if reader.cursor != body_len:
        raise WireFormatError(
            f"frame header describes {reader.cursor} body bytes but the body has {body_len}."
        )
    return obj


def decode(buffer: Any, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """Decode the single frame that fills ``buffer``.

    ``buffer`` is ``bytes``, ``bytearray``, a memoryview, a C-contiguous uint8 numpy array
    or a contiguous uint8 CPU tensor. Arrays in the result (and tensors, for writable
    buffers) are views of ``buffer``; the module docstring says exactly when. An empty
    buffer decodes to ``None`` (nothing was sent), as in :func:`decode_many`. Raises
    :class:`~evenflow.transports.errors.WireFormatError` for anything else that is not one
    valid frame of at most ``max_frame_bytes`` bytes.
    """
    limit = check_max_frame_bytes(max_frame_bytes)
    view = _as_view(buffer)
    return _decode_frame(view, limit) if len(view) else None


def decode_many(
    buffer: Any,
    sizes: Iterable[SupportsIndex],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> list[Any]:
    """Split ``buffer`` into consecutive frames of the given ``sizes`` and decode each.

    The sizes (ints, or an integer numpy array or tensor) must be non-negative and add up
    to the buffer's length. A zero-length
    segment decodes to ``None`` (a peer that sent nothing), so this inverts
    :func:`encode_many` exactly. Each other segment is checked like :func:`decode`, with
    ``max_frame_bytes`` applying to each frame.
    """
    limit = check_max_frame_bytes(max_frame_bytes)
    view = _as_view(buffer)
    try:
        lengths = [operator.index(size) for size in sizes]
    except TypeError as exc:
        raise WireFormatError(f"frame sizes must be integers, but got {sizes!r}.") from exc
    if any(length < 0 for length in lengths) or sum(lengths) != len(view):
        raise WireFormatError(
            f"frame sizes {lengths!r} must be non-negative and add up to the buffer's "
            f"{len(view)} bytes."
        )
    fast = _decode_many_compiled(view, lengths, limit)
    if fast is not NotImplemented:
        return fast  # type: ignore[no-any-return]
    # Some frame was declined: decode frame by frame, so that an error names its frame.
    out: list[Any] = []
    position = 0
    for index, length in enumerate(lengths):
        if not length:
            out.append(None)
            continue
        try:
            out.append(_decode_frame(view[position : position + length], limit))
        except WireFormatError as exc:
            raise WireFormatError(f"frame {index} of {len(lengths)}: {exc}") from exc
        position += length
    return out
