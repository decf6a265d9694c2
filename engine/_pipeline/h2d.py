"""Host-to-device staging: copy collated batches to the accelerator ahead of the training step.

Two halves, on two threads:

* :meth:`DeviceStager.stage` runs on a worker thread. It pins every CPU tensor of the batch,
  enqueues the copies on one dedicated copy stream and records a *ready event* behind them.
  The host does not wait for the copies.
* :meth:`DeviceStager.deliver` runs on the training thread. It makes the training thread's
  current stream wait for the ready event (a device-side dependency, no host sync) and calls
  ``record_stream`` on every device tensor, so the caching allocator will not hand their memory
  to anyone else until the training stream is done with them. Without that the memory,
  allocated on the copy stream, could be reused as soon as the Python object dies while
  kernels on the training stream still read it.

The pinned copies feed DMA transfers that are still in flight when ``stage()`` returns, so the
stager keeps them, with their event, until the event has completed (checked cheaply on every
call) or :meth:`close` synchronises it. Events of one stream complete in order, so the retained
queue is drained from its head.

With ``device=None`` or a CPU device the stager is inactive: batches stay on the host and both
halves return what they are given. No accelerator API is touched unless a non-CPU device is
requested, so the module imports and runs on a CPU-only torch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from evenflow.engine._validate import check_bool, check_callable
from evenflow.engine.errors import ConfigError, LoaderStateError

__all__ = ["DeviceStager", "StagedBatch"]

MoveFn = Callable[[Any, torch.device], Any]


@dataclass(slots=True)
class StagedBatch:
    """A batch whose copies to the device are enqueued but possibly not finished.

    ``host`` is the batch as the host produced it (the loader exposes it as
    ``last_host_batch``); ``batch`` is the device batch, valid on the training stream only
    after :meth:`DeviceStager.deliver`; ``event`` is the copy stream's ready event.
    """

    host: Any
    batch: Any
    event: Any = field(repr=False)


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuild(template: Any, items: list[Any]) -> Any:
    """A sequence of ``template``'s kind holding ``items``."""
    if isinstance(template, list):
        return items
    if _is_namedtuple(template):
        return type(template)(*items)
    return tuple(items)


def _rebuild_mapping(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if type(template) is dict:
        return items
    factory: Any = type(template)
    try:
        return factory(items)
    except TypeError:  # a Mapping type that cannot be built from a dict
        return items


def _map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every leaf of nested dicts, lists and tuples (namedtuples kept)."""
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, {k: _map_leaves(v, fn) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return _rebuild(value, [_map_leaves(v, fn) for v in value])
    return fn(value)


def _visit_leaves(value: Any, fn: Callable[[Any], None]) -> None:
    if isinstance(value, Mapping):
        for item in value.values():
            _visit_leaves(item, fn)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _visit_leaves(item, fn)
    else:
        fn(value)


def _pin_leaf(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        if leaf.device.type != "cpu" or leaf.is_pinned():
            return leaf
        return leaf.pin_memory()
    pin = getattr(leaf, "pin_memory", None)
    return pin() if callable(pin) else leaf


def default_move(batch: Any, device: torch.device) -> Any:
    """Move every tensor (and every object with a callable ``.to``) of ``batch`` to ``device``
    with ``non_blocking=True``; other leaves (ints, strings, numpy arrays) stay as they are.
    Custom objects must accept ``.to(device, non_blocking=True)``."""

    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(device, non_blocking=True)
        to = getattr(leaf, "to", None)
        return to(device, non_blocking=True) if callable(to) else leaf

    return _map_leaves(batch, move)


def _load_device_module(device: torch.device) -> Any:
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as exc:
            raise ConfigError(
                f"device {str(device)!r} needs the torch_npu package, which is not installed; "
                "install it or pass device=None to keep batches on the host."
            ) from exc
    try:
        module = torch.get_device_module(device)
    except RuntimeError as exc:
        raise ConfigError(
            f"device {str(device)!r} has no torch device module; pass a 'cuda' or 'npu' device, "
            "or device=None to keep batches on the host."
        ) from exc
    return module


class DeviceStager:
    """Copies host batches to ``device`` on a copy stream, ahead of the training step.

    Args:
        device: the training device (``"cuda:0"``, ``torch.device("npu", 1)``, ...). ``None``
            or a CPU device makes the stager inactive: batches stay on the host.
        move_fn: ``move_fn(batch, device) -> device_batch`` replacing the default recursive
            mover; it runs inside the copy stream on the pinned batch.
        cpu_fields: top-level keys of a mapping batch left on the host untouched (not pinned,
            not moved), e.g. string ids or metadata. Missing keys are ignored.
        pin_memory: pin CPU tensors before copying (needed for truly asynchronous copies).

    ``stage()`` is called from one worker thread at a time and ``deliver()`` from the training
    thread, in the same order; :meth:`close` is idempotent.
    """

    def __init__(
        self,
        device: str | torch.device | None,
        *,
        move_fn: MoveFn | None = None,
        cpu_fields: Iterable[Any] = (),
        pin_memory: bool = True,
        _device_module: Any = None,
    ) -> None:
        if move_fn is not None:
            check_callable("move_fn", move_fn)
        if isinstance(cpu_fields, (str, bytes)):
            raise ConfigError(
                f"cpu_fields must be a collection of keys, but got the string {cpu_fields!r}; "
                f"pass a tuple such as ({cpu_fields!r},)."
            )
        try:
            fields = frozenset(cpu_fields)
        except TypeError as exc:
            raise TypeError(
                f"cpu_fields must be a collection of hashable keys, but got {cpu_fields!r}; "
                "pass a tuple of field names such as ('ids',)."
            ) from exc
        self._move_fn: MoveFn = move_fn if move_fn is not None else default_move
        self._cpu_fields = fields
        self._pin = check_bool("pin_memory", pin_memory)
        self._device = self._check_device(device)
        self._module: Any = None
        self._lock = threading.Lock()
        self._thread_state = threading.local()  # .bound: the device is current on this thread
        self._copy_stream: Any = None
        self._retained: deque[tuple[Any, Any]] = deque()  # (ready event, pinned staging)
        self._closed = False
        if self._device is not None and self._device.type != "cpu":
            module = _device_module  # tests inject a recording stand-in here
            if module is None:
                module = _load_device_module(self._device)
                if not module.is_available():
                    raise ConfigError(
                        f"device {str(self._device)!r} is not available in this process; pass "
                        "device=None to keep batches on the host."
                    )
            self._module = module
            index: int | None = self._device.index  # typed int, but None for "cuda"
            if index is None:
                # Resolve now, on the thread that owns the training device.
                self._device = torch.device(self._device.type, module.current_device())
            for name in ("Stream", "Event", "stream", "current_stream"):
                if not callable(getattr(module, name, None)):
                    raise ConfigError(
                        f"device {str(self._device)!r} does not support streams and events "
                        f"(torch.{self._device.type}.{name} is missing); pass device=None and "
                        "move batches in the training loop."
                    )

    @staticmethod
    def _check_device(device: object) -> torch.device | None:
        if device is None:
            return None
        if isinstance(device, torch.device):
            return device
        if isinstance(device, str):
            try:
                return torch.device(device)
            except RuntimeError as exc:
                raise ConfigError(
                    f"device must be None or a torch device such as 'cuda:0', but got "
                    f"{device!r}: {exc}"
                ) from exc
        raise TypeError(
            f"device must be None, a string such as 'cuda:0' or a torch.device, but got "
            f"{device!r} ({type(device).__name__})."
        )

    @property
    def active(self) -> bool:
        """Whether batches go to an accelerator (False: they stay on the host)."""
        return self._module is not None

    @property
    def device(self) -> torch.device | None:
        """The target device (index resolved), or ``None`` when inactive with no device."""
        return self._device

    @property
    def num_retained(self) -> int:
        """Pinned stagings still held because their copies may be in flight."""
        with self._lock:
            return len(self._retained)

    def _check_batch(self, batch: Any) -> None:
        if self._cpu_fields and not isinstance(batch, Mapping):
            raise TypeError(
                f"cpu_fields={sorted(self._cpu_fields, key=repr)!r} needs a mapping batch (a "
                f"dict of fields), but the batch is a {type(batch).__name__}; collate to a dict "
                "or pass cpu_fields=()."
            )

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise LoaderStateError(f"DeviceStager.{op}() was called after close().")

    def _release_completed_locked(self) -> None:
        while self._retained and self._retained[0][0].query():
            self._retained.popleft()

    def pin(self, host_batch: Any) -> Any:
        """``host_batch`` with its CPU tensors pinned, for a later :meth:`stage` (which then
        pins nothing): a step that waits on the host for a device slot waits pinned, so its
        copy can start at once. ``cpu_fields`` are left as they are. Inactive, or with
        ``pin_memory=False``: returns ``host_batch`` itself.
        """
        self._check_open("pin")
        self._check_batch(host_batch)
        if self._module is None or not self._pin:
            return host_batch
        if self._cpu_fields:
            pinned = {
                k: v if k in self._cpu_fields else _map_leaves(v, _pin_leaf)
                for k, v in host_batch.items()
            }
            return _rebuild_mapping(host_batch, pinned)
        return _map_leaves(host_batch, _pin_leaf)

    def stage(self, host_batch: Any) -> Any:
        """Enqueue the copies of ``host_batch``; returns a :class:`StagedBatch`.

        Runs on a worker thread. Inactive: returns ``host_batch`` itself.
        """
        self._check_open("stage")
        self._check_batch(host_batch)
        module = self._module
        if module is None:
            return host_batch
        assert self._device is not None
        if not getattr(self._thread_state, "bound", False):
            # Streams, events and allocations belong to the thread's current device.
            module.set_device(self._device)
            self._thread_state.bound = True
        if self._copy_stream is None:
            self._copy_stream = module.Stream(device=self._device)
        stream = self._copy_stream

        if self._cpu_fields:
            kept = {k: v for k, v in host_batch.items() if k in self._cpu_fields}
            movable: Any = {k: v for k, v in host_batch.items() if k not in self._cpu_fields}
        else:
            kept, movable = {}, host_batch
        staging = _map_leaves(movable, _pin_leaf) if self._pin else movable
        try:
            with module.stream(stream):
                moved = self._move_fn(staging, self._device)
            if self._cpu_fields and not isinstance(moved, Mapping):
                raise TypeError(
                    f"move_fn must return a mapping when cpu_fields is set, but it returned a "
                    f"{type(moved).__name__}; return a dict of fields."
                )
            event = module.Event()
            event.record(stream)
        except BaseException:
            # Copies from ``staging`` may be in flight: wait for this stream only (the training
            # stream keeps running), then let the pinned buffers go. The traceback may still
            # reference them through move_fn's frame, which is safe once the stream is idle.
            stream.synchronize()
            del staging
            raise
        if self._cpu_fields:
            # The host batch's key order first, then any key move_fn added.
            merged = {
                k: kept[k] if k in kept else moved[k] for k in host_batch if k in kept or k in moved
            }
            merged.update((k, v) for k, v in moved.items() if k not in merged)
            moved = _rebuild_mapping(host_batch, merged)
        with self._lock:
            self._release_completed_locked()
            self._retained.append((event, staging))
        return StagedBatch(host=host_batch, batch=moved, event=event)

    def deliver(self, staged: Any) -> Any:
        """Make the device batch usable on the current stream and return it.

        Runs on the training thread: the current stream waits for the copies (no host sync)
        and every device tensor is recorded on it. Inactive: returns ``staged`` itself.
        """
        self._check_open("deliver")
        module = self._module
        if module is None:
            return staged
        if not isinstance(staged, StagedBatch):
            raise TypeError(
                f"deliver() takes what stage() returned (a StagedBatch), but got "
                f"{type(staged).__name__}."
            )
        current = module.current_stream(self._device)
        current.wait_event(staged.event)
        device_type = self._device.type if self._device is not None else ""

        def record(leaf: Any) -> None:
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type == device_type:
                    leaf.record_stream(current)
                return
            hook = getattr(leaf, "record_stream", None)
            if callable(hook):
                hook(current)

        batch = staged.batch
        if self._cpu_fields and isinstance(batch, Mapping):
            for key, value in batch.items():
                if key not in self._cpu_fields:
                    _visit_leaves(value, record)
        else:
            _visit_leaves(batch, record)
        with self._lock:
            self._release_completed_locked()
        return batch

    def close(self) -> None:
        """Wait for every retained copy to finish and release the pinned stagings."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            retained, self._retained = self._retained, deque()
        try:
            for event, _ in retained:
                event.synchronize()
        finally:
            retained.clear()
            self._copy_stream = None
