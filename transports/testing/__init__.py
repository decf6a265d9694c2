"""Testing wing: the transport conformance suite and the local multi-process launcher.

``conformance`` holds :func:`check_transport` (run it against every transport, your own too:
it takes a maker of fresh groups); ``inprocess`` the in-process runners and
:func:`check_inprocess_conformance`; ``wrapped`` the delegating base for test doubles
(:class:`WrappedTransport`); ``launch`` spawns N real torch.distributed ranks on this machine
for tests, benchmarks and the demo. ``evenflow.transports.testing`` serves the conformance and
in-process names, ``evenflow.transports.launch`` the launcher's.
"""

from __future__ import annotations

from evenflow.transports.testing.conformance import GroupMaker, check_transport
from evenflow.transports.testing.inprocess import (
    check_inprocess_conformance,
    run_inprocess,
    run_inprocess_threads,
)
from evenflow.transports.testing.wrapped import WrappedTransport

__all__ = [
    "GroupMaker",
    "WrappedTransport",
    "check_inprocess_conformance",
    "check_transport",
    "run_inprocess",
    "run_inprocess_threads",
]
