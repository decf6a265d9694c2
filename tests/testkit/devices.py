"""The stand-in for ``torch.cuda`` the device-path tests use: the project's host device
(``engine/_tools/host_device.py``: streams, events and the current device, doing nothing), so
the device code path runs on a CPU-only build. Tests install it with
``monkeypatch.setattr(h2d, "_load_device_module", lambda device: FakeDevice())`` and record
what they need themselves."""

from __future__ import annotations

from evenflow.engine._tools.host_device import HostDevice as FakeDevice
from evenflow.engine._tools.host_device import HostEvent as FakeEvent
from evenflow.engine._tools.host_device import HostStream as FakeStream

__all__ = ["FakeDevice", "FakeEvent", "FakeStream"]
