"""The engine's face of evenflow.transports: the transport machinery that is not public API.

**Who may use it.** :mod:`evenflow.engine` (its core, its integrations and its tools), and
nobody else. The engine imports public names (``GlooTransport``, ``create_transport``,
``encode``, the errors...) from the public modules like any user does, and from here only what
the public face does not serve; it imports nothing from a private ``evenflow.transports._*``
module (``tests/test_imports.py`` checks that).

**Why it is separate from** :mod:`evenflow.transports`. The public face is a promise to users:
the names there keep their meaning across releases and appear in the docs. The names here are
the building blocks the engine shares with the transports: the one byte protocol that every
torch.distributed path speaks (:class:`Protocol`, :class:`Channel`, the group helpers), the
model-parallel batch broadcast, the remote-error description that crosses process boundaries,
and the worker threads that own blocking calls. They change when the engine and the transports
change together, in one commit, so they must not be offered to users; yet the engine needs one
documented place to take them from, rather than ten private modules whose layout is the
transports' own business.

**What is stable.** Within one version of the project, every name below, with the contract
its own docstring states. Across versions, nothing: a change here updates the engine in the
same commit. Moving a name between private modules changes only the table below.

Names are served lazily, as in the public face, so importing this module loads only the
private modules whose names the importer asks for (the model-parallel broadcast, say, only
where the engine builds one).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Served lazily at run time (see __getattr__); type checkers see the real objects.
    from evenflow.transports._broadcast import BatchBroadcaster
    from evenflow.transports._channel import Channel
    from evenflow.transports._protocol import (
        ROLL_CALL_SECONDS,
        Protocol,
        destroy_group,
        new_group,
        pack_outgoing,
    )
    from evenflow.transports._remote import (
        NOTE_PREFIX,
        RemoteErrorInfo,
        one_line,
        traceback_note,
    )
    from evenflow.transports._threads import ThreadInterrupt, WorkerThreads, unwrap

_LAZY: dict[str, str] = {
    # The model-parallel batch broadcast (one rank reads, its group receives the batch).
    "BatchBroadcaster": "evenflow.transports._broadcast",
    # The one byte protocol and its process groups.
    "Channel": "evenflow.transports._channel",
    "Protocol": "evenflow.transports._protocol",
    "ROLL_CALL_SECONDS": "evenflow.transports._protocol",
    "destroy_group": "evenflow.transports._protocol",
    "new_group": "evenflow.transports._protocol",
    "pack_outgoing": "evenflow.transports._protocol",
    # Errors as plain data across process boundaries.
    "NOTE_PREFIX": "evenflow.transports._remote",
    "RemoteErrorInfo": "evenflow.transports._remote",
    "one_line": "evenflow.transports._remote",
    "traceback_note": "evenflow.transports._remote",
    # Threads that own blocking calls.
    "ThreadInterrupt": "evenflow.transports._threads",
    "WorkerThreads": "evenflow.transports._threads",
    "unwrap": "evenflow.transports._threads",
}

__all__ = [
    "BatchBroadcaster",
    "Channel",
    "NOTE_PREFIX",
    "Protocol",
    "ROLL_CALL_SECONDS",
    "RemoteErrorInfo",
    "ThreadInterrupt",
    "WorkerThreads",
    "destroy_group",
    "new_group",
    "one_line",
    "pack_outgoing",
    "traceback_note",
    "unwrap",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evenflow.transports.internal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
