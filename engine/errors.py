"""The engine's errors, rooted in the data plane's tree (``evenflow.transports.errors``).

::

    EvenflowError
    ├── ConfigError (ValueError)        invalid configuration or argument
    ├── PlanningError                   an algorithm returned an invalid layout, a cost was bad
    ├── LoaderStateError (RuntimeError) the loader was used in the wrong lifecycle state
    ├── RemoteStageError                another rank of the group failed; names rank, stage, step
    ├── GroupMismatchError              ranks disagree (plan digest, config fingerprint, step)
    ├── ResumeError (ValueError)        a checkpoint does not match this loader
    ├── SourceExhaustedError            a rank's source ended early and ``on_uneven_end="raise"``
    ├── StallTimeoutError (TimeoutError) no step arrived within ``LoaderConfig.timeout``
    ├── TransformWorkerError (RuntimeError) a transform worker process died or hung
    └── TransportError ...              (see evenflow.transports.errors)
"""

from __future__ import annotations

from evenflow.transports.errors import (
    CollectiveMismatchError,
    ConfigError,
    EncodeError,
    EvenflowError,
    PeerEncodeError,
    PeerFailureError,
    RouteError,
    TransportClosedError,
    TransportError,
    TransportTimeoutError,
    WireFormatError,
)
from evenflow.transports.internal import RemoteErrorInfo, one_line, traceback_note

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "EncodeError",
    "EvenflowError",
    "GroupMismatchError",
    "LoaderStateError",
    "PeerEncodeError",
    "PeerFailureError",
    "PlanningError",
    "RemoteStageError",
    "ResumeError",
    "RouteError",
    "SourceExhaustedError",
    "StallTimeoutError",
    "TransformWorkerError",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "WireFormatError",
]


class PlanningError(EvenflowError):
    """Planning failed: a cost model returned a bad value or an algorithm an invalid layout."""


class LoaderStateError(EvenflowError, RuntimeError):
    """The loader was used in a lifecycle state that does not allow the operation."""


class RemoteStageError(EvenflowError):
    """A stage failed on another rank of the balance group, so this rank stops too.

    Every surviving rank raises this at the same step; the failing rank re-raises its own
    exception object. ``str()`` is one line naming the rank, stage, step and the original
    error; the failing rank's traceback text is kept in ``remote_traceback`` and shown as a
    ``__notes__`` entry, so logging and printed tracebacks include it while messages that
    embed ``str()`` stay short.
    """

    def __init__(
        self,
        *,
        failed_rank: int,
        stage: str,
        step: int,
        error_type: str,
        message: str,
        remote_traceback: str = "",
    ) -> None:
        super().__init__(
            f"Rank {failed_rank} failed in stage {stage!r} at step {step}: "
            f"{error_type}: {one_line(message)}"
        )
        self.failed_rank = failed_rank
        self.stage = stage
        self.step = step
        self.error_type = error_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.add_note(traceback_note(f"rank {failed_rank}", remote_traceback))

    @classmethod
    def from_info(cls, info: RemoteErrorInfo, *, failed_rank: int) -> RemoteStageError:
        """The error a peer raises for a checked remote description (``failed_rank`` global)."""
        return cls(
            failed_rank=failed_rank,
            stage=info.stage,
            step=info.step if info.step is not None else -1,
            error_type=info.error_type,
            message=info.message,
            remote_traceback=info.traceback,
        )

    def to_info(self) -> RemoteErrorInfo:
        """This error's origin as plain data, to forward it unchanged to further ranks."""
        return RemoteErrorInfo(
            rank=self.failed_rank,
            stage=self.stage,
            step=self.step if self.step >= 0 else None,
            error_type=self.error_type,
            module="",
            message=self.remote_message,
            traceback=self.remote_traceback,
        )


class GroupMismatchError(EvenflowError):
    """Ranks of one group disagree on something that must be identical everywhere."""


class ResumeError(EvenflowError, ValueError):
    """A saved loader state cannot be restored into this loader; the message says what differs."""


class SourceExhaustedError(EvenflowError):
    """A rank's source ended before the others' (raised when ``on_uneven_end='raise'``)."""


class StallTimeoutError(EvenflowError, TimeoutError):
    """No step reached the caller within ``LoaderConfig.timeout`` (a blocked source or stage)."""


class TransformWorkerError(EvenflowError, RuntimeError):
    """A transform worker process of a source died (e.g. SIGKILL by the OOM killer) or did not
    answer within ``LoaderConfig.timeout``; the message names the process and the dataset
    indices it was transforming."""
