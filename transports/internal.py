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
same commit. Moving a name between private modules changes only its line below.

Names are served lazily, as in the public face, so importing this module loads only the
private modules whose names the importer asks for (the model-parallel broadcast, say, only
where the engine builds one). Each is declared once, as ``from module import name as name``
(see ``transports/_face.py``, whose ``serve`` the engine's own faces use from here). Unlike the
public faces, this one leaves its classes' ``__module__`` alone: these names are not documented
under this module's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evenflow.transports import _face

# The machinery of the public faces, for the engine's own (evenflow.engine, .planning).
from evenflow.transports._face import serve as serve

if TYPE_CHECKING:
    # The model-parallel batch broadcast (one rank reads, its group receives the batch).
    from evenflow.transports._broadcast import BatchBroadcaster as BatchBroadcaster

    # isort: split
    # The one byte protocol and its process groups.
    from evenflow.transports._channel import Channel as Channel
    from evenflow.transports._protocol import ROLL_CALL_SECONDS as ROLL_CALL_SECONDS
    from evenflow.transports._protocol import Protocol as Protocol
    from evenflow.transports._protocol import destroy_group as destroy_group
    from evenflow.transports._protocol import new_group as new_group
    from evenflow.transports._protocol import pack_outgoing as pack_outgoing

    # isort: split
    # Errors as plain data across process boundaries.
    from evenflow.transports._remote import NOTE_PREFIX as NOTE_PREFIX
    from evenflow.transports._remote import RemoteErrorInfo as RemoteErrorInfo
    from evenflow.transports._remote import one_line as one_line
    from evenflow.transports._remote import traceback_note as traceback_note

    # isort: split
    # Threads that own blocking calls.
    from evenflow.transports._threads import ThreadInterrupt as ThreadInterrupt
    from evenflow.transports._threads import WorkerThreads as WorkerThreads
    from evenflow.transports._threads import unwrap as unwrap

_face.serve(__name__, public_module=False)
