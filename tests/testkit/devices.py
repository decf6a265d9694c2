"""A stand-in for ``torch.cuda``: the slice the loader's device stager calls (streams, events,
the current device), doing nothing, so the device code path runs on a CPU-only build. Tests
install it with ``monkeypatch.setattr(h2d, "_load_device_module", lambda device: FakeDevice())``
and record what they need themselves."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FakeDevice", "FakeEvent", "FakeStream"]


class FakeStream:
    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class FakeEvent:
    def record(self, stream: FakeStream) -> None:
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


class FakeDevice:
    """The slice of ``torch.cuda`` the stager uses; it records nothing, the test does."""

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def set_device(self, device: torch.device) -> None:
        pass

    def Stream(self, device: torch.device) -> FakeStream:
        return FakeStream()

    def Event(self) -> FakeEvent:
        return FakeEvent()

    def stream(self, stream: FakeStream) -> _Context:
        return _Context()

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        return FakeStream()
