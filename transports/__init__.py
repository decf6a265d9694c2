"""evenflow.transports — moving bytes between the ranks of a balance group.

Every public name is declared once below, as ``from module import name as name``: at top level
when it is imported with the package, under ``TYPE_CHECKING`` when it is served lazily on first
access (type checkers read the same line). ``_face.serve`` derives ``__all__`` and the lazy
lookup from these lines; see ``transports/_face.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evenflow.transports import _face
from evenflow.transports import errors as errors
from evenflow.transports._base import InlineLauncher as InlineLauncher
from evenflow.transports._base import Launcher as Launcher
from evenflow.transports._base import Transport as Transport

if TYPE_CHECKING:
    from evenflow.transports._device import DeviceTransport as DeviceTransport
    from evenflow.transports._gloo import GlooTransport as GlooTransport
    from evenflow.transports._inprocess import InProcessGroup as InProcessGroup
    from evenflow.transports._inprocess import InProcessStatistics as InProcessStatistics
    from evenflow.transports._inprocess import InProcessTransport as InProcessTransport
    from evenflow.transports._local import LocalTransport as LocalTransport
    from evenflow.transports._registry import create_transport as create_transport
    from evenflow.transports._registry import register_transport as register_transport
    from evenflow.transports._sized import Prepared as Prepared
    from evenflow.transports._sized import prepare as prepare
    from evenflow.transports._wire import DEFAULT_MAX_FRAME_BYTES as DEFAULT_MAX_FRAME_BYTES
    from evenflow.transports._wire import decode as decode
    from evenflow.transports._wire import decode_many as decode_many
    from evenflow.transports._wire import encode as encode
    from evenflow.transports._wire import encode_many as encode_many

_face.serve(__name__)
