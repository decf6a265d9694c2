"""The world round: one small all-gather per step across balance groups, on the loader's own
world transport.

A balance group learns its own loss targets from its metadata rounds, but the plan-free loss
normaliser is the whole data-parallel world's count (see
:mod:`evenflow.engine._pipeline.loss_tokens`). When the world holds more than one balance
group, every balanced rank takes part in one more collective per step over a transport that
spans one rank per data-parallel coordinate (``build_loader`` creates it as a Gloo group of the
constructors: never a training group). Each rank sends a few plain values: the step, its
status for the step, the loss targets of its packed batch, and what it read (for the
end-of-pass report). Every sample of the world is packed by exactly one rank, so the sum is
the world's total, whatever each group planned.

Ordering (invariant 1): the round is a pipeline stage after ``pack``, so each rank issues the
rounds in step order from one task, and the transport runs them on its own single-worker
executor. Like a metadata round, the round of step ``s + 1`` is awaited before step ``s`` is
delivered: a rank that stops after taking the last step of a pass has then taken part in every
round of the pass, so closing it never leaves a peer waiting in a round. The world transport
is Gloo and runs off the caller's thread (invariant 2 concerns device transports only). Each
step's round overlaps the planning, exchange and packing of later steps, so it stays off the
training critical path.

Fail and stop together across groups: a rank whose group ended or failed at step ``s`` says so
in round ``s``. Every rank sees the same round, so every rank stops issuing rounds after the
first round that holds an end or an error (a rank then has no further round that a peer
could wait for), and

* an error anywhere raises a :class:`~evenflow.engine.errors.RemoteStageError` naming the
  failing rank on every rank whose own step was fine;
* an end anywhere ends the pass at ``s`` on every rank: a rank whose own step was fine
  records the uneven end (``state.world_end``) and the pipeline drains its group, exactly as
  for an uneven end inside a group, or raises ``SourceExhaustedError`` under
  ``on_uneven_end="raise"``.

The stage (:class:`WorldStage`) needs from the step its status, error and ``loss`` record, and
what it read (sizes, metadata, ``steps_left``). It adds the world's total to ``loss``, and
``world_end`` or ``remote`` from the world's verdict; a failed round (after a roll call that
names the ranks that are gone) becomes the step's ``remote``. Nothing is raised. A step
delivered before a restore has no round (in every group alike).
"""

from __future__ import annotations

import logging
from typing import Any

from evenflow.engine._pipeline.pass_report import RankUnread, UnevenEnd
from evenflow.engine._pipeline.progress import Progress
from evenflow.engine._pipeline.step import StepState
from evenflow.engine.errors import GroupMismatchError, RemoteStageError, SourceExhaustedError
from evenflow.transports import Transport
from evenflow.transports.errors import TransportError, WireFormatError
from evenflow.transports.internal import ROLL_CALL_SECONDS

__all__ = ["WorldRound", "WorldStage"]

logger = logging.getLogger("evenflow")

_VERSION = 1
#: The tag of the world's roll call: a Gloo group is dead after its first failure, so one
#: roll call per world transport is all there can be.
_ROLL_CALL = "world-failed"


def _status(state: StepState) -> str:
    if state.error is not None or state.remote is not None:
        return "error"
    if state.terminal:
        return "end"
    return "ok"


class WorldRound:
    """Sums each step's loss tokens over the world and applies the world's verdict.

    ``transport=None``: the balance group is the whole world; the world total is the group's
    and no collective is issued. Call :meth:`run` once per step, in step order, from one task.
    """

    def __init__(self, transport: Transport | None, *, on_uneven_end: str) -> None:
        self._transport = transport
        self._on_uneven_end = on_uneven_end
        self._stopped = False  # a round held an end or an error: no later round is issued
        # The round whose collective itself failed (a peer crashed or froze), and its error.
        self._failed: tuple[int, BaseException] | None = None

    @property
    def spans_groups(self) -> bool:
        return self._transport is not None

    @property
    def stopped(self) -> bool:
        """Whether a round held an end or an error (no later round will be issued)."""
        return self._stopped

    def failure_before(self, step: int) -> BaseException | None:
        """The error of a failed round at ``step`` or before, if one failed.

        Step ``s`` is delivered only after round ``s + 1``, like after metadata round
        ``s + 1``. When that collective itself fails (a peer crashed), every surviving rank of
        the world sees the failure at the same round, while a survivor in the dead rank's
        own group may also see its group fail one round later: both must then stop at ``s``,
        not deliver it on some ranks and not on others.
        """
        failed = self._failed
        return failed[1] if failed is not None and failed[0] <= step else None

    async def run(self, state: StepState) -> None:
        if self._transport is None:
            return  # the group is the world: its total arrives with the next metadata round
        if self._stopped:
            return
        status = _status(state)
        message: dict[str, Any] = {
            "v": _VERSION,
            "step": state.step,
            "status": status,
            "end_reason": state.end_reason,
            "loss": (None if state.loss is None else state.loss.rank) if status == "ok" else 0,
            "samples": 0 if state.sizes is None else sum(state.sizes),
            "tokens": 0 if state.metas is None else sum(m.tokens for m in state.metas),
            "left": state.steps_left,
            "error": None,
        }
        if status == "error":
            # [type, message, whether it failed here]: peers name a rank that failed itself
            # over ranks that only stopped for a peer of their group.
            own = state.error is not None
            exc = state.error if own else state.remote
            message["error"] = [type(exc).__name__, str(exc), own]
        try:
            messages = await self._transport.all_gather(message)
        except Exception as exc:
            # Stopped only once the error is complete: a delivery waiting for this round must
            # not go on (or raise a half-told error) while the roll call runs.
            error = await self._blame(exc, state.step)
            self._failed = (state.step, error)
            self._stopped = True
            if status == "ok":
                state.remote = error
            return
        self._judge(state, status, messages)

    async def _blame(self, exc: Exception, step: int) -> Exception:
        """``exc`` naming the ranks that did not answer a roll call (who crashed): Gloo names a
        failed peer by address only, so in a world of three or more ranks the error said
        nothing of who was gone."""
        roll_call = getattr(self._transport, "roll_call", None)
        if not isinstance(exc, TransportError) or not callable(roll_call):
            return exc
        missing = await roll_call(_ROLL_CALL)
        if not missing:
            return exc
        names = ", ".join(map(str, missing))
        blamed = type(exc)(
            f"{exc} The world round of step {step} failed: rank(s) {names} did not answer "
            f"a roll call of the survivors within {ROLL_CALL_SECONDS:g} s — they crashed or "
            "are stuck (every other rank answered).",
            rank=exc.rank,
            op=exc.op,
            peer_rank=exc.peer_rank,
        )
        blamed.missing_ranks = missing  # type: ignore[attr-defined]
        blamed.__cause__ = exc
        return blamed

    async def answer_roll_call(self) -> None:
        """This rank is alive: answer the world's roll call after a failure, without waiting
        (a rank whose own balance group failed first may never run the failed world round,
        but the survivors' roll call must not count it among the dead)."""
        roll_call = getattr(self._transport, "roll_call", None)
        if callable(roll_call):
            await roll_call(_ROLL_CALL, 0.0)

    def _judge(self, state: StepState, status: str, messages: list[Any]) -> None:
        assert self._transport is not None
        ranks = self._transport.global_ranks
        for sender, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("v") != _VERSION:
                self._stopped = True
                state.remote = state.remote or WireFormatError(
                    f"Malformed world round message from rank {ranks[sender]}: {m!r:.120}. "
                    "Every rank must run the same evenflow."
                )
                return
        steps = [m.get("step") for m in messages]
        if any(s != state.step for s in steps):
            self._stopped = True
            state.remote = state.remote or GroupMismatchError(
                f"Balance groups are at different steps in the world round: rank {ranks[0]} "
                f"at {steps[0]!r}, others at {steps!r}. Every group must start (or resume) "
                "at the same step."
            )
            return
        statuses = [m.get("status") for m in messages]
        if "error" in statuses:
            self._stopped = True
            if status == "ok":
                summaries = [_error_summary(m.get("error")) for m in messages]
                failed = [r for r, st in enumerate(statuses) if st == "error"]
                sender = next((r for r in failed if summaries[r][2]), failed[0])
                kind, text, _ = summaries[sender]
                state.remote = RemoteStageError(
                    failed_rank=ranks[sender],
                    stage="world",
                    step=state.step,
                    error_type=kind,
                    message=f"the balance group of rank {ranks[sender]} stopped: {text}",
                )
            return
        if "end" in statuses:
            self._stopped = True
            if any(m.get("end_reason") == "restart" for m in messages):
                return  # set_epoch() drains every group: nothing is dropped by design
            uneven = _world_uneven(state.step, messages, ranks)
            if uneven is None:
                return
            if status == "ok":
                if self._on_uneven_end == "raise":
                    state.remote = SourceExhaustedError(uneven.message("raise"))
                else:
                    state.world_end = uneven
                    logger.warning("%s", uneven.message("stop"))
            elif status == "end" and state.uneven is None and state.remote is None:
                # This group ended first: it reports what the others still had.
                state.uneven = uneven
                if self._on_uneven_end == "raise":
                    state.remote = SourceExhaustedError(uneven.message("raise"))
                else:
                    logger.warning("%s", uneven.message("stop"))
            return
        losses = [m.get("loss") for m in messages]
        known = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in losses)
        if known and state.loss is not None:  # (this rank's own count is among them)
            state.loss.world = sum(losses)


class WorldStage:
    """Runs each step's world round in step order (see the module)."""

    def __init__(self, world: WorldRound, progress: Progress) -> None:
        self._world = world
        self._progress = progress

    async def run(self, state: StepState) -> None:
        if state.skip:
            return  # delivered before the restore, in every group alike: no round
        await self._world.run(state)
        self._progress.world_step = state.step
        self._progress.notify()


def _error_summary(value: Any) -> tuple[str, str, bool]:
    """``(type, message, failed_there)`` of a peer's error entry (peer data: checked)."""
    if (
        isinstance(value, list)
        and len(value) == 3
        and isinstance(value[0], str)
        and isinstance(value[1], str)
        and isinstance(value[2], bool)
    ):
        return value[0], value[1], value[2]
    return "Error", "no description", False


def _world_uneven(step: int, messages: list[Any], ranks: tuple[int, ...]) -> UnevenEnd | None:
    """What the ranks still held when others ended at ``step`` (``None`` if all ended)."""
    statuses = [m.get("status") for m in messages]
    if all(s == "end" for s in statuses):
        return None
    unread = []
    for r, m in enumerate(messages):
        if m.get("status") != "ok":
            continue
        left = m.get("left")
        more = left if isinstance(left, int) and not isinstance(left, bool) and left >= 0 else None
        unread.append(RankUnread(ranks[r], int(m.get("samples", 0)), int(m.get("tokens", 0)), more))
    ended = tuple(ranks[r] for r, s in enumerate(statuses) if s == "end")
    return UnevenEnd(step=step, ended_ranks=ended, unread=tuple(unread))
