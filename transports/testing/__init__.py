"""Testing wing: the transport conformance suite and the local multi-process launcher.

``conformance`` holds :func:`check_transport` (run it against every transport, your own too) and
the in-process runners; ``wrapped`` the delegating base for test doubles
(:class:`WrappedTransport`); ``launch`` spawns N real torch.distributed ranks on this machine for
tests, benchmarks and the demo. ``evenflow.transports.testing`` serves the conformance names,
``evenflow.transports.launch`` the launcher's.
"""

from __future__ import annotations

from evenflow.transports.testing.conformance import (
    check_inprocess_conformance,
    check_transport,
    run_inprocess,
    run_inprocess_threads,
)
from evenflow.transports.testing.wrapped import WrappedTransport

__all__ = [
    "WrappedTransport",
    "check_inprocess_conformance",
    "check_transport",
    "run_inprocess",
    "run_inprocess_threads",
]
