"""The exchange stage: the samples a plan moves go to the ranks that pack them, in one
collective.

Every rank computes both sides of every transfer from data all ranks share (the plan, and the
frame sizes gathered in the metadata round), so the exchange needs no sizes round: what this
rank sends comes from its routes and its prepared frames, what it receives from the routes of
its bins and the senders' announced sizes (:meth:`ExchangeStage.sized`). A step whose plan
moves nothing (or that was delivered before a restore) takes its turn without a collective, on
every rank alike.

Needs from the step: ``plan``, ``routes``, ``messages`` (or its window's), its frames.
Adds: ``received`` (``{key: sample}`` for every sample of this rank's bins read elsewhere).
A rank that cannot encode its payloads fails its own step (stage ``exchange``), and its peers
record a :class:`~evenflow.engine.errors.RemoteStageError` for the step; a failed collective is
reported to the pipeline (``Hooks.group_failed``), which ends the pass. Nothing is raised. In a
balance window, the samples sent are dropped from the window's share.

In shared-dataset mode :class:`~evenflow.engine._pipeline.read_assigned.AssignedStage` takes
this stage's place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evenflow.engine._pipeline.progress import Hooks, Progress
from evenflow.engine._pipeline.sequencer import Sequencer
from evenflow.engine._pipeline.step import StepState
from evenflow.engine.errors import RemoteStageError
from evenflow.transports import Prepared, Transport
from evenflow.transports.errors import (
    CollectiveMismatchError,
    PeerEncodeError,
    PeerFailureError,
    TransportClosedError,
    TransportTimeoutError,
)

__all__ = ["ExchangeStage"]

#: Failures of the collective itself: the group is unusable afterwards.
GROUP_FAILURES = (
    TransportTimeoutError,
    PeerFailureError,
    CollectiveMismatchError,
    TransportClosedError,
)


class ExchangeStage:
    """Runs each step's exchange in its turn (see the module)."""

    def __init__(
        self, *, transport: Transport, sequencer: Sequencer, progress: Progress, hooks: Hooks
    ) -> None:
        self._transport = transport
        self._sequencer = sequencer
        self._progress = progress
        self._hooks = hooks
        self._rank = transport.rank
        self._global_ranks = transport.global_ranks

    async def run(self, state: StepState) -> None:
        if state.terminal:
            return
        plan = state.plan
        moves = plan is not None and plan.num_moved > 0 and not state.skip
        await self._sequencer.turn(state.step, "exchange")
        if moves:
            outgoing, incoming = self.sized(state)
            self._progress.exchanging = state.step
            try:
                state.received = await self._transport.exchange_sized(outgoing, incoming)
            except PeerEncodeError as exc:
                # No data moved anywhere; the failing rank announces its own error in the next
                # metadata round, which replaces this summary with its message.
                failed = exc.failed_ranks[0] if exc.failed_ranks else 0
                state.remote = RemoteStageError(
                    failed_rank=self._global_ranks[failed],
                    stage="exchange",
                    step=state.step,
                    error_type="EncodeError",
                    message=str(exc),
                )
            except GROUP_FAILURES as exc:
                await self._hooks.group_failed(state, exc, "exchange")
                return
            except Exception as exc:
                # This rank could not encode its payloads; by the transport contract its peers
                # were told (PeerEncodeError) and the group is still in step.
                state.fail("exchange", exc)
            if state.window is not None and state.routes is not None:
                # Sent: the reading rank no longer needs these samples.
                state.window.forget(state.routes.send.values(), self._rank)
        self._progress.exchanged_step = state.step
        self._progress.notify()
        await self._sequencer.advance(state.step, "exchange")

    def sized(
        self, state: StepState
    ) -> tuple[dict[int, list[tuple[Any, Prepared]]], dict[int, list[tuple[Any, int]]]]:
        """What this rank sends (its prepared samples, by target) and what it receives (keys
        and frame sizes, by sender), both from the plan and the gathered metadata, which every
        rank shares; so both sides of every pair count the same bytes and the exchange needs
        no sizes collective. Both lists follow the receiver's pack order. A key names the step
        that read it: in a balance window, any step of the window."""
        routes = state.routes
        assert routes is not None
        sizes = {
            step: [np.asarray(m["nbytes"], dtype=np.int64) for m in messages]
            for step, messages in state.step_messages().items()
        }
        if state.window is not None and state.window.prepared is not None:
            prepared = state.window.prepared
        elif state.prepared is not None and state.error is None:
            prepared = {state.step: state.prepared}
        else:
            # Cannot happen while read errors end the step at its gather; kept safe anyway:
            # the announced number of bytes still goes out, as zeros the receivers report.
            own = sizes[state.step][self._rank]
            prepared = {state.step: [Prepared.zeros(int(n)) for n in own]}
        outgoing = {
            dest: [(key, prepared[key[1]][key[2]]) for key in keys]
            for dest, keys in routes.send.items()
        }
        incoming: dict[int, list[tuple[Any, int]]] = {}
        for keys in routes.bins:
            for key in keys:
                if key[0] != self._rank:
                    size = int(sizes[key[1]][key[0]][key[2]])
                    incoming.setdefault(key[0], []).append((key, size))
        return outgoing, incoming
