"""``DeviceTransport``: the byte protocol on device tensors, launched on the caller's thread.

This is the NCCL/HCCL design (invariant 2 of the design): collectives share the device with
the training step, so they are only *launched* at launch points, on the training loop's
thread, through :attr:`Transport.launcher`; everything that blocks or costs CPU (encoding,
``work.wait()``, device-to-host copies, decoding) runs on this transport's single *waiter*
thread. The protocol is that of :mod:`evenflow.transports._protocol` (sizes first, validated,
then ONE uint8 collective), so one operation is two launches: the sizes collective
(``final=False``) and, after the waiter has read the sizes back to the host, the data
collective (``final=True``). ``exchange_sized`` — the engine's exchange, whose sizes every
rank already knows from the metadata round (:mod:`evenflow.transports._sized`) — is ONE
launch: the data collective alone.

On an accelerator the bytes go host → pinned staging buffer → device (on a dedicated data
stream) → collective → device → pinned staging buffer → decode, and decoded arrays are views
of the pinned receive buffer. With ``device="cpu"`` (or ``None`` on a Gloo group) the same
code runs on CPU tensors with no staging and no streams: that is how it is tested without an
accelerator. Every accelerator call is behind ``self._accel``, so a CPU-only torch imports
and runs this module; ``torch_npu`` is imported only when an ``npu`` device is asked for.

Limits: a timeout on an accelerator backend is enforced by that backend's own watchdog (the
group's ``timeout``), which may abort the process rather than raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from evenflow.transports._base import Outgoing, Transport, check_timeout
from evenflow.transports._protocol import (
    CLOSE_DEADLINE,
    FAILED,
    Protocol,
    close_owned,
    membership,
    open_group,
    pack_outgoing,
)
from evenflow.transports._sized import (
    SizedIncoming,
    SizedOutgoing,
    check_sized,
    decode_segments,
    write_segments,
)
from evenflow.transports._threads import WorkerThreads
from evenflow.transports._wire import DEFAULT_MAX_FRAME_BYTES, check_max_frame_bytes, decode_many
from evenflow.transports.errors import TransportError, WireFormatError

__all__ = ["DeviceTransport"]

T = TypeVar("T")


def _resolve_device(device: torch.device | str | None, group_backend: str | None) -> torch.device:
    """The device the byte tensors live on; ``None`` picks the group's natural one."""
    if device is None:
        if group_backend == "gloo" or not torch.accelerator.is_available():
            return torch.device("cpu")
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            return torch.device("cpu")
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be a torch.device, a device string such as 'cuda:0' or 'cpu', or "
            f"None, but got {device!r}."
        ) from exc
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "npu":
        importlib.import_module("torch_npu")  # registers torch.npu; only on demand
    try:
        module = torch.get_device_module(resolved)
        if not module.is_available():
            raise RuntimeError(f"{resolved.type} is not available")
        index = module.current_device() if resolved.index is None else resolved.index
    except (RuntimeError, AttributeError, AssertionError) as exc:
        raise ValueError(
            f"device {device!r} cannot be used by this torch build or machine ({exc}); pass "
            f"device='cpu' to run over a Gloo group."
        ) from exc
    return torch.device(resolved.type, index)


def _backend_for(device: torch.device) -> str:
    if device.type == "cpu":
        return "gloo"
    return str(dist.get_default_backend_for_device(device))


class DeviceTransport(Transport):
    """Collectives on device byte tensors, launched only through :attr:`launcher`.

    ``process_group=None`` creates a dedicated group over ``ranks`` (default: the world) with
    the device's backend (NCCL for CUDA, HCCL for NPU, Gloo for CPU) and ``timeout``; like
    ``new_group`` this must run on every rank of the world in the same order. ``device=None``
    means CPU on a Gloo group, else the current accelerator. The engine installs a launcher
    that runs launches on the training thread at launch points; outside the engine launches
    run inline on the event loop's thread. ``aclose()`` joins the waiter thread and destroys
    the group if this transport created it.
    """

    name = "device"
    launch_on_caller = True

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        ranks: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        timeout: float = 30.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        seconds = check_timeout(timeout)
        limit = check_max_frame_bytes(max_frame_bytes)
        given_backend = None
        if process_group is not None and dist.is_initialized():
            given_backend = str(dist.get_backend(process_group))
        self._device = _resolve_device(device, given_backend)
        group, created = open_group(
            process_group, ranks, seconds, _backend_for(self._device), "DeviceTransport"
        )
        super().__init__(**membership(group), timeout=seconds)
        self._group = group
        self._owns_group = created
        self._proto = Protocol.of(self, limit)
        self._broken: TransportError | None = None
        self._accel = self._device.type != "cpu"
        # Accelerator handles exist only on an accelerator: a CPU build never touches them.
        self._module: Any = None
        self._stream: Any = None
        if self._accel:
            self._module = torch.get_device_module(self._device)
            self._stream = self._module.Stream(device=self._device)
        self._waiter = WorkerThreads(1, name=f"evenflow-device-wait-r{dist.get_rank()}")
        self._finalizer = weakref.finalize(self, self._waiter.shutdown, wait=False)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_frame_bytes(self) -> int:
        return self._proto.limit

    # -- public operations ----------------------------------------------------------------------

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, ordered by group rank."""
        op = "all_gather"
        self._check_ready(op)
        n = self.num_ranks
        frame, error = await self._off_thread(op, functools.partial(self._encode_one, op, obj))
        size = frame.numel() if error is None else FAILED
        incoming = await self._exchange_sizes(op, [size] * n)
        await self._abort_if_failed(op, error, incoming)

        def source() -> torch.Tensor:
            # all_to_all_single needs one input segment per peer: the frame, n times.
            on_device = self._upload(frame)
            return on_device.repeat(n) if n > 1 else on_device

        gathered: list[Any] = await self._move(op, source, [frame.numel()] * n, incoming)
        return gathered

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        """Member ``src``'s ``obj`` on every member (``src`` too gets a decoded copy)."""
        op = "broadcast"
        self._check_ready(op)
        self._check_src(src)
        error: Exception | None = None
        frame = torch.empty(0, dtype=torch.uint8)
        if self.rank == src:
            frame, error = await self._off_thread(op, functools.partial(self._encode_one, op, obj))
        announced = frame.numel() if error is None else FAILED
        size_host = await self._off_thread(op, lambda: self._stage(np.array([announced])))
        box: list[torch.Tensor] = []

        def launch_size() -> Any:
            box.append(self._upload(size_host))
            return dist.broadcast(box[0], group=self._group, group_src=src, async_op=True)

        work = await self._launch(op, launch_size, final=False)
        announced = int(await self._off_thread(op, lambda: self._wait_host(op, work, box[0])[0]))
        incoming = [0] * self.num_ranks
        incoming[src] = announced
        await self._abort_if_failed(op, error, incoming)

        def launch_data() -> Any:
            if self.rank == src:
                box.append(self._upload(frame))
            else:
                box.append(torch.empty(announced, dtype=torch.uint8, device=self._device))
            return dist.broadcast(box[1], group=self._group, group_src=src, async_op=True)

        work = await self._launch(op, launch_data, final=True)

        def finish() -> Any:
            received = self._wait_host(op, work, box[1])
            return decode_many(received, [announced], max_frame_bytes=self._proto.limit)[0]

        return await self._off_thread(op, finish)

    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        """Send each ``(key, payload)`` to its target; return what arrived for this rank."""
        op = "exchange"
        self._check_ready(op)
        self._check_routes(outgoing)
        buffer, sizes, error = await self._off_thread(
            op, functools.partial(self._encode_exchange, outgoing)
        )
        incoming = await self._exchange_sizes(op, sizes)
        await self._abort_if_failed(op, error, incoming)
        frames = await self._move(op, lambda: self._upload(buffer), sizes, incoming)
        return self._proto.merge_exchange(op, frames)

    async def exchange_sized(
        self, outgoing: SizedOutgoing, incoming: SizedIncoming
    ) -> dict[Hashable, Any]:
        """One launch: the data collective, its splits from the prepared sizes and ``incoming``."""
        op = "exchange"
        self._check_ready(op)
        send, recv = check_sized(
            self.rank, self.num_ranks, outgoing, incoming, limit=self._proto.limit
        )

        def write() -> tuple[torch.Tensor, Exception | None]:
            buffer = np.empty(sum(send), dtype=np.uint8)
            failed = write_segments(outgoing, send, buffer)
            return self._stage(buffer), failed

        staged, error = await self._off_thread(op, write)
        limit = self._proto.limit
        received = await self._move(
            op,
            lambda: self._upload(staged),
            send,
            recv,
            decode=lambda host: decode_segments(host, incoming, recv, rank=self.rank, limit=limit),
        )
        if error is not None:
            raise error
        return received  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Join the waiter thread and destroy the group this transport created."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            await close_owned(
                self._waiter,
                self._group,
                destroy=self._owns_group and self._broken is None,
                deadline=min(self.timeout, CLOSE_DEADLINE),
            )
            # The group's sockets and communicator go with its last reference.
            self._group = None  # type: ignore[assignment]

    # -- the two launches of one operation ------------------------------------------------------

    async def _exchange_sizes(self, op: str, sizes: list[int]) -> list[int]:
        """Launch 1 of 2 (``final=False``): every sender's byte count, read back to the host."""
        host = await self._off_thread(op, lambda: self._stage(np.asarray(sizes, dtype=np.int64)))
        box: list[torch.Tensor] = []

        def launch() -> Any:
            send = self._upload(host)
            recv = torch.empty(self.num_ranks, dtype=torch.int64, device=self._device)
            box.extend((send, recv))
            return dist.all_to_all_single(recv, send, group=self._group, async_op=True)

        work = await self._launch(op, launch, final=False)
        counts = await self._off_thread(op, lambda: self._wait_host(op, work, box[1]))
        return [int(s) for s in counts.tolist()]

    async def _move(
        self,
        op: str,
        make_source: Callable[[], torch.Tensor],
        sizes: list[int],
        incoming: list[int],
        decode: Callable[[npt.NDArray[np.uint8]], Any] | None = None,
    ) -> Any:
        """Launch 2 of 2 (``final=True``): the bytes; then wait, copy back and decode (one
        frame per sender, or ``decode(host_bytes)``)."""
        box: list[torch.Tensor] = []

        def launch() -> Any:
            source = make_source()
            recv = torch.empty(sum(incoming), dtype=torch.uint8, device=self._device)
            box.extend((source, recv))  # both stay alive until the collective is done
            return dist.all_to_all_single(
                recv,
                source,
                output_split_sizes=incoming,
                input_split_sizes=sizes,
                group=self._group,
                async_op=True,
            )

        work = await self._launch(op, launch, final=True)

        def finish() -> Any:
            host = self._wait_host(op, work, box[1])
            if decode is not None:
                return decode(host)
            return decode_many(host, incoming, max_frame_bytes=self._proto.limit)

        return await self._off_thread(op, finish)

    async def _abort_if_failed(self, op: str, error: Exception | None, incoming: list[int]) -> None:
        """Raise the group's verdict on the sizes; close the operation's launches if so."""
        try:
            if error is not None:
                raise error
            self._proto.check_incoming(op, incoming)
        except BaseException as exc:
            if isinstance(exc, WireFormatError):
                # Our sender will launch its data step without us: the group is out of step.
                self._broken = TransportError(str(exc), rank=self.rank, op=op)
            # A launch point may wait for the operation's final launch: give it an empty one.
            await self.launcher.launch(lambda: None, op=op, final=True)
            raise

    # -- helpers --------------------------------------------------------------------------------

    def _check_ready(self, op: str) -> None:
        self._check_open(op)
        if self._broken is not None:
            raise type(self._broken)(
                f"Rank {self.rank}: cannot run {op}: an earlier failure made this {self.name} "
                f"group unusable ({self._broken}).",
                rank=self.rank,
                op=op,
                peer_rank=self._broken.peer_rank,
            ) from self._broken

    def _encode_one(self, op: str, obj: Any) -> tuple[torch.Tensor, Exception | None]:
        try:
            return self._stage(self._proto.encode_one(op, obj)), None
        except Exception as exc:
            return torch.empty(0, dtype=torch.uint8), exc

    def _encode_exchange(
        self, outgoing: Outgoing
    ) -> tuple[torch.Tensor, list[int], Exception | None]:
        try:
            packed = pack_outgoing(self.rank, outgoing)
            buffer, sizes = self._proto.encode_exchange("exchange", packed)
            return self._stage(buffer), sizes, None
        except Exception as exc:
            return torch.empty(0, dtype=torch.uint8), [FAILED] * self.num_ranks, exc

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._accel:
            with self._module.stream(self._stream):
                yield
        else:
            yield

    def _stage(self, array: npt.NDArray[Any]) -> torch.Tensor:
        """``array`` as a host tensor ready to upload: pinned on an accelerator (waiter side).

        The staging buffer must outlive the asynchronous upload; callers keep it referenced
        until the operation's final wait, which orders after the upload on the data stream.
        """
        host = torch.from_numpy(array)
        if not self._accel:
            return host
        staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        staging.copy_(host)
        return staging

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device, enqueued on the data stream (launch side, non-blocking)."""
        if not self._accel:
            return host
        out = torch.empty(host.shape, dtype=host.dtype, device=self._device)
        out.copy_(host, non_blocking=True)
        return out

    def _wait_host(self, op: str, work: Any, tensor: torch.Tensor) -> npt.NDArray[Any]:
        """Wait for ``work``, then return ``tensor``'s bytes on the host (runs on the waiter)."""
        try:
            with self._on_stream():
                work.wait()
                if not self._accel:
                    return tensor.numpy()
                staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                staging.copy_(tensor, non_blocking=True)
                event = self._module.Event()
                event.record(self._stream)
            event.synchronize()
            return staging.numpy()
        except RuntimeError as exc:
            error = self._proto.translate(op, exc)
            self._broken = error
            raise error from exc

    async def _launch(self, op: str, fn: Callable[[], T], *, final: bool) -> T:
        def launch() -> T:
            try:
                with self._on_stream():
                    return fn()
            except RuntimeError as exc:
                error = self._proto.translate(op, exc)
                self._broken = error
                raise error from exc

        return await self.launcher.launch(launch, op=op, final=final)

    async def _off_thread(self, op: str, fn: Callable[[], T]) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._waiter, fn)
        try:
            return await future
        except asyncio.CancelledError:
            self._broken = TransportError(
                f"Rank {self.rank}: {op} was cancelled while in flight.", rank=self.rank, op=op
            )
            raise
