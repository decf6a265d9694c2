"""Run a function on N real torch.distributed ranks on this machine.

``run_ranks(fn, num_ranks)`` spawns ``num_ranks`` processes, initialises a process group over
loopback in each, calls ``fn(rank, num_ranks, *args)`` and returns every rank's result.
``RankPool`` keeps such a world alive so that many calls (test cases, benchmark cases) share
one start-up, which costs ~1-2 s per spawn.

Guarantees:

* **Deadline.** Every call has a wall-clock deadline. When it passes, every rank is killed by
  PID with SIGKILL and :class:`RankDeadlineError` names the ranks that were still running.
  pytest-timeout cannot interrupt a rank blocked in a collective; this can.
* **Failures are reported, not hung on.** An exception in a rank is re-raised in the parent as
  :class:`RankFailedError` with the rank, the exception type, its message and the remote
  traceback text; a rank that dies (exit code, signal) is reported as such. After the first
  failure the other ranks get ``failure_grace`` seconds to report (a peer of a dead rank
  usually fails within milliseconds); what they reported is kept in ``error.outcomes``.
* **No orphans.** Every exit path of the parent (return, error, deadline, KeyboardInterrupt,
  garbage collection of a forgotten pool) kills the ranks; each rank also watches its parent
  and exits when the parent dies.
* **No pickle on data.** ``fn`` travels as its module and qualified name, arguments and
  results as msgpack over a pipe. So ``fn`` must be a module-level function and arguments and
  results must be plain data: None, bool, int, float, str, bytes, lists, tuples (they arrive
  as lists) and dicts.

A failed or timed-out ``RankPool.run`` tears the pool down (its collectives may be out of
step); the next ``run`` starts a fresh world.

This module is the parent side; what runs inside each spawned rank, and the plain-data codec
both sides share, is :mod:`evenflow.transports.testing._rank`.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

from evenflow.transports._remote import RemoteErrorInfo, one_line, traceback_note
from evenflow.transports.errors import EvenflowError, WireFormatError
from evenflow.transports.testing._rank import describe_function, pack, rank_main, unpack

__all__ = ["LaunchError", "RankDeadlineError", "RankFailedError", "RankPool", "run_ranks"]

_BACKENDS = ("gloo", "nccl", "hccl", "mpi")
_STOP_GRACE_S = 5.0
_PORT_RETRIES = 3


class LaunchError(EvenflowError, RuntimeError):
    """A multi-process run did not complete: a rank failed, died or ran past its deadline."""


class RankFailedError(LaunchError):
    """A rank raised an exception or died.

    ``rank`` is the first rank that failed; ``exc_type``, ``remote_message`` and
    ``remote_traceback`` describe its exception (None when it died without one, in which case
    ``exitcode`` is set: negative for a signal). ``str()`` is one line; the remote traceback is
    also a ``__notes__`` entry, so a printed or logged traceback shows where the rank failed
    (the same convention as ``RemoteStageError``). ``outcomes`` maps every rank to what it
    reported before the pool was torn down: ``("result", value)``, ``("error", text)``,
    ``("died", text)`` or ``("killed", text)``.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exc_type: str | None,
        remote_message: str | None,
        remote_traceback: str | None,
        exitcode: int | None,
        outcomes: dict[int, tuple[str, Any]],
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.outcomes = outcomes


class RankDeadlineError(LaunchError, TimeoutError):
    """The deadline passed; ``ranks`` lists those still running (all were killed)."""

    def __init__(self, message: str, *, ranks: list[int], deadline: float) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.deadline = deadline


# -- the parent side --------------------------------------------------------------------------


def _free_port() -> int:
    # Bind-then-release leaves a small window for a race; start-up retries on "address in use".
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _kill_all(procs: Sequence[BaseProcess]) -> None:
    """SIGKILL every live rank by PID and reap it."""
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=10.0)


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _check_env(env: object, num_ranks: int) -> list[dict[str, str]]:
    if env is None:
        return [{} for _ in range(num_ranks)]
    if isinstance(env, Mapping):
        per_rank = [env] * num_ranks
    elif isinstance(env, Sequence) and not isinstance(env, (str, bytes)):
        if len(env) != num_ranks:
            raise ValueError(
                f"env must be one mapping or a list of num_ranks={num_ranks} mappings, but got "
                f"a list of {len(env)}; pass one dict per rank."
            )
        per_rank = list(env)
    else:
        raise TypeError(f"env must be a mapping or a list of mappings, but got {env!r}.")
    result = []
    for mapping in per_rank:
        if not isinstance(mapping, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
        ):
            raise TypeError(
                f"env entries must map str to str, but got {mapping!r}; convert values to str."
            )
        result.append(dict(mapping))
    return result


def _check_deadline(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, but got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, but got {value!r}; pass a number of seconds.")
    return float(value)


class _World:
    """One started set of ranks with their pipes; owned by a RankPool."""

    def __init__(self, procs: list[BaseProcess], conns: list[Connection]) -> None:
        self.procs = procs
        self.conns = conns

    def kill(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        _kill_all(self.procs)


def _finalize_world(holder: list[_World | None]) -> None:
    world = holder[0]
    holder[0] = None
    if world is not None:
        world.kill()


class RankPool:
    """``num_ranks`` live processes with an initialised process group, reused across calls.

    Use as a context manager (``with RankPool(2, timeout=5.0) as pool: pool.run(fn, x)``).
    ``run`` sends ``fn`` to every rank, which calls ``fn(rank, num_ranks, *args)``; it returns
    the list of results indexed by rank. ``deadline`` (seconds) bounds every start-up and is
    the default bound of a call (``run(..., deadline=...)`` overrides it for one call; a
    restart before the call is bounded separately). ``timeout`` is the process group's own
    timeout. Not thread-safe: one call at a time.
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        backend: str = "gloo",
        env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        timeout: float = 10.0,
        deadline: float = 60.0,
        failure_grace: float = 3.0,
    ) -> None:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive integer, but got {num_ranks!r}.")
        if backend not in _BACKENDS:
            raise ValueError(
                f"backend must be one of {', '.join(map(repr, _BACKENDS))}, but got {backend!r}."
            )
        self._num_ranks = num_ranks
        self._backend = backend
        self._env = _check_env(env, num_ranks)
        self._timeout = _check_deadline("timeout", timeout)
        self._deadline = _check_deadline("deadline", deadline)
        self._grace = _check_deadline("failure_grace", failure_grace)
        self._closed = False
        # The finalizer holds the world through a list so that it never references self.
        self._holder: list[_World | None] = [None]
        self._finalizer = weakref.finalize(self, _finalize_world, self._holder)
        self.num_starts = 0

    @property
    def num_ranks(self) -> int:
        return self._num_ranks

    @property
    def running(self) -> bool:
        """Whether a started world is alive and ready for ``run``."""
        return self._holder[0] is not None

    @property
    def pids(self) -> list[int]:
        """PIDs of the running ranks (empty when not started)."""
        world = self._holder[0]
        return [] if world is None else [p.pid for p in world.procs if p.pid is not None]

    def start(self, *, deadline: float | None = None) -> None:
        """Spawn the ranks and wait until every one has joined the process group."""
        if self._closed:
            raise LaunchError("This RankPool is closed; create a new one.")
        if self._holder[0] is not None:
            return
        budget = self._deadline if deadline is None else _check_deadline("deadline", deadline)
        until = time.monotonic() + budget
        for attempt in range(_PORT_RETRIES):
            try:
                self._start_once(until, budget)
                return
            except RankFailedError as exc:
                text = (exc.remote_message or "").lower()
                retry = "address already in use" in text or "eaddrinuse" in text
                if not retry or attempt == _PORT_RETRIES - 1:
                    raise

    def _start_once(self, until: float, budget: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        world = _World(procs, conns)
        try:
            for rank in range(self._num_ranks):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=rank_main,
                    kwargs={
                        "rank": rank,
                        "num_ranks": self._num_ranks,
                        "port": port,
                        "backend": self._backend,
                        "timeout": self._timeout,
                        "env": self._env[rank],
                        "conn": child_end,
                    },
                    name=f"evenflow-rank-{rank}",
                    daemon=False,
                )
                procs.append(proc)
                conns.append(parent_end)
                proc.start()
                child_end.close()
            self.num_starts += 1
            self._collect(world, until, budget, "start-up", expect="ready")
        except BaseException:
            world.kill()
            raise
        self._holder[0] = world

    def run(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> list[Any]:
        """Call ``fn(rank, num_ranks, *args)`` on every rank; return the results by rank."""
        desc = describe_function(fn)
        try:
            packed_args = unpack(pack(list(args)))
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"args must be plain data (None, bool, int, float, str, bytes, lists, dicts) "
                f"because they travel as msgpack, but got {args!r}: {exc}"
            ) from exc
        budget = self._deadline if deadline is None else _check_deadline("deadline", deadline)
        # (Re)starting the world is bounded by the pool's own deadline, not the call's.
        self.start()
        until = time.monotonic() + budget
        world = self._holder[0]
        assert world is not None
        request = pack({"kind": "run", **desc, "args": packed_args})
        try:
            for conn in world.conns:
                conn.send_bytes(request)
            return self._collect(world, until, budget, desc["qualname"], expect="result")
        except BaseException:
            self._teardown()
            raise

    def _collect(
        self, world: _World, until: float, budget: float, what: str, *, expect: str
    ) -> list[Any]:
        """Wait for one ``expect`` message per rank, a failure, or the deadline."""
        outcomes: dict[int, tuple[str, Any]] = {}
        errors: dict[int, RemoteErrorInfo] = {}
        first_failure: int | None = None
        wait_until = until
        by_handle: dict[Any, tuple[str, int]] = {}
        for rank, (proc, conn) in enumerate(zip(world.procs, world.conns, strict=True)):
            by_handle[conn] = ("conn", rank)
            by_handle[proc.sentinel] = ("proc", rank)
        pending = set(range(self._num_ranks))
        eof: set[int] = set()

        def fail(rank: int, kind: str, value: Any) -> None:
            nonlocal first_failure, wait_until
            outcomes[rank] = (kind, value)
            pending.discard(rank)
            if first_failure is None:
                first_failure = rank
                wait_until = min(until, time.monotonic() + self._grace)

        def read(rank: int) -> bool:
            """Read one message of ``rank`` if there is one; False when its pipe is closed."""
            conn = world.conns[rank]
            try:
                if not conn.poll():
                    return True
                message = unpack(conn.recv_bytes())
            except (EOFError, OSError):
                eof.add(rank)
                return False
            if message["kind"] == expect:
                outcomes[rank] = ("result", message.get("value"))
                pending.discard(rank)
            elif message["kind"] == "error":
                try:
                    info = RemoteErrorInfo.from_wire(message.get("error"), sender=f"rank {rank}")
                except WireFormatError as exc:
                    info = RemoteErrorInfo.from_exception(exc, rank=rank, stage=what, step=None)
                errors[rank] = info
                fail(rank, "error", f"{info.qualified_type}: {one_line(info.message)}")
            return True

        while pending:
            remaining = wait_until - time.monotonic()
            if remaining <= 0:
                break
            handles = [
                h
                for h, (_, r) in by_handle.items()
                if r in pending and not (isinstance(h, Connection) and r in eof)
            ]
            ready = multiprocessing.connection.wait(handles, timeout=remaining)
            for handle in ready:
                kind, rank = by_handle[handle]
                if rank not in pending:
                    continue
                if kind == "conn":
                    read(rank)
                else:
                    # Drain a last message first: a rank reports its error, then exits.
                    while rank in pending and world.conns[rank].poll():
                        if not read(rank):
                            break
                    if rank in pending:
                        world.procs[rank].join(timeout=1.0)
                        code = world.procs[rank].exitcode
                        fail(rank, "died", f"rank {rank} {_exit_text(code)}")

        if first_failure is None and not pending:
            return [outcomes[r][1] for r in range(self._num_ranks)]
        still_running = sorted(pending)
        world.kill()
        self._holder[0] = None
        for rank in still_running:
            outcomes[rank] = ("killed", f"rank {rank} was killed by the launcher")
        if first_failure is None:
            hint = (
                # Start-up runs no collective of the caller's: spawning, importing and joining
                # the process group were merely slow (a loaded machine, a cold import cache).
                "Start-up spawns the processes, imports the code and joins the process group; "
                "raise the deadline if the machine is busy."
                if what == "start-up"
                else "Look for a rank blocked in a collective, or raise the deadline."
            )
            raise RankDeadlineError(
                f"{what} did not finish within its deadline of {budget:g} s: rank(s) "
                f"{', '.join(map(str, still_running))} of {self._num_ranks} were still running "
                f"and were killed (SIGKILL). {hint}",
                ranks=still_running,
                deadline=budget,
            )
        raise self._failure(first_failure, errors, outcomes, world, what)

    def _failure(
        self,
        rank: int,
        errors: dict[int, RemoteErrorInfo],
        outcomes: dict[int, tuple[str, Any]],
        world: _World,
        what: str,
    ) -> RankFailedError:
        summary = {"result": "rank {r} returned", "error": "rank {r} raised {v}"}
        others = "; ".join(
            summary.get(kind, "{v}").format(r=r, v=value)
            for r, (kind, value) in sorted(outcomes.items())
            if r != rank
        )
        error = errors.get(rank)
        if error is not None:
            message = (
                f"Rank {rank} of {self._num_ranks} raised {error.qualified_type} in {what}: "
                f"{one_line(error.message)}"
            )
            if others:
                message += f" Other ranks: {others}."
            failure = RankFailedError(
                message,
                rank=rank,
                exc_type=error.qualified_type,
                remote_message=error.message,
                remote_traceback=error.traceback,
                exitcode=world.procs[rank].exitcode,
                outcomes=outcomes,
            )
            if error.traceback:
                failure.add_note(traceback_note(f"rank {rank}", error.traceback))
            return failure
        code = world.procs[rank].exitcode
        message = f"Rank {rank} of {self._num_ranks} {_exit_text(code)} during {what}."
        if others:
            message += f" Other ranks: {others}."
        return RankFailedError(
            message,
            rank=rank,
            exc_type=None,
            remote_message=None,
            remote_traceback=None,
            exitcode=code,
            outcomes=outcomes,
        )

    def _teardown(self) -> None:
        _finalize_world(self._holder)

    def close(self) -> None:
        """Stop the ranks (cleanly if they answer, else SIGKILL). Idempotent."""
        self._closed = True
        world = self._holder[0]
        self._holder[0] = None
        if world is None:
            return
        try:
            for conn in world.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(pack({"kind": "stop"}))
            until = time.monotonic() + _STOP_GRACE_S
            for proc in world.procs:
                proc.join(timeout=max(0.0, until - time.monotonic()))
        finally:
            world.kill()

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            # On an error (KeyboardInterrupt included) do not wait for a clean stop.
            self._closed = True
            self._teardown()


def run_ranks(
    fn: Callable[..., Any],
    num_ranks: int,
    *,
    args: Sequence[Any] = (),
    deadline: float = 60.0,
    backend: str = "gloo",
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    timeout: float = 10.0,
) -> list[Any]:
    """Run ``fn(rank, num_ranks, *args)`` on ``num_ranks`` fresh processes; return results.

    ``deadline`` bounds the whole run (start-up included); ``timeout`` is the process group
    timeout; ``env`` adds environment variables to every rank (a mapping) or per rank (a list
    of mappings). See the module docstring for what is reported and guaranteed.
    """
    budget = _check_deadline("deadline", deadline)
    until = time.monotonic() + budget
    describe_function(fn)
    pool = RankPool(num_ranks, backend=backend, env=env, timeout=timeout, deadline=budget)
    with pool:  # starts the world within ``budget``
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise RankDeadlineError(
                f"The ranks started but the deadline of {budget:g} s was used up by start-up; "
                f"raise the deadline.",
                ranks=list(range(num_ranks)),
                deadline=budget,
            )
        return pool.run(fn, *args, deadline=remaining)
