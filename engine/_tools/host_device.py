"""A stand-in for ``torch.cuda`` that acts on the host, for tools and tests on CPU-only builds.

The loader's device stager (``engine/_pipeline/h2d.py``) reaches the accelerator through
``h2d._load_device_module(device)``; returning a :class:`HostDevice` there makes a CPU-only run
take the device path (device slots, pinning of the steps that wait, the ``h2d`` stage and its
spans) with every stream and event complete at once. The pipeline digests run it in their
rank processes, and the device-prefetch tests install it with ``monkeypatch``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HostDevice", "HostEvent", "HostStream"]


class HostStream:
    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class HostEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Context:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


class HostDevice:
    """The slice of ``torch.cuda`` the stager uses: streams, events, the current device."""

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        pass

    def Stream(self, device: Any = None) -> HostStream:
        return HostStream()

    def Event(self) -> HostEvent:
        return HostEvent()

    def stream(self, stream: Any) -> _Context:
        return _Context()

    def current_stream(self, device: Any = None) -> HostStream:
        return HostStream()
