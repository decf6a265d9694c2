"""evenflow.transports — moving bytes between the ranks of a balance group."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from evenflow.transports import errors
from evenflow.transports._base import InlineLauncher, Launcher, Transport

if TYPE_CHECKING:
    # The names below are served lazily at run time (see __getattr__); type checkers
    # import them here so that users see the real classes and functions, never Any.
    from evenflow.transports._device import DeviceTransport
    from evenflow.transports._gloo import GlooTransport
    from evenflow.transports._inprocess import (
        InProcessGroup,
        InProcessStatistics,
        InProcessTransport,
    )
    from evenflow.transports._local import LocalTransport
    from evenflow.transports._registry import create_transport, register_transport
    from evenflow.transports._sized import Prepared, prepare
    from evenflow.transports._wire import (
        DEFAULT_MAX_FRAME_BYTES,
        decode,
        decode_many,
        encode,
        encode_many,
    )

_LAZY: dict[str, str] = {
    "encode": "evenflow.transports._wire",
    "encode_many": "evenflow.transports._wire",
    "decode": "evenflow.transports._wire",
    "decode_many": "evenflow.transports._wire",
    "InProcessStatistics": "evenflow.transports._inprocess",
    "DEFAULT_MAX_FRAME_BYTES": "evenflow.transports._wire",
    "LocalTransport": "evenflow.transports._local",
    "InProcessGroup": "evenflow.transports._inprocess",
    "InProcessTransport": "evenflow.transports._inprocess",
    "GlooTransport": "evenflow.transports._gloo",
    "DeviceTransport": "evenflow.transports._device",
    "Prepared": "evenflow.transports._sized",
    "prepare": "evenflow.transports._sized",
    "create_transport": "evenflow.transports._registry",
    "register_transport": "evenflow.transports._registry",
}

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "DeviceTransport",
    "GlooTransport",
    "InProcessGroup",
    "InProcessStatistics",
    "InProcessTransport",
    "InlineLauncher",
    "Launcher",
    "LocalTransport",
    "Prepared",
    "Transport",
    "create_transport",
    "decode",
    "decode_many",
    "encode",
    "encode_many",
    "errors",
    "prepare",
    "register_transport",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evenflow.transports' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
