"""The transport conformance suite: :func:`check_transport`, run against every transport.

Every transport, built-in or your own, should pass it. It takes a *maker*, not a transport,
as trio's stream conformance checks do: each check runs on fresh transports, so one failure
(a group left out of step, a timed-out collective) hides no other, and the lifecycle itself
can be checked (close twice, use after close, two groups alive at once)::

    # one process: the maker returns every member of a fresh in-process group
    await check_transport(lambda: [InProcessGroup(4).transport(r) for r in range(4)])

    # N processes (or threads): every rank runs the suite at once; the maker returns this
    # rank's member of a fresh group, and every rank calls it at the same point
    await check_transport(lambda: GlooTransport(timeout=5.0))

The suite issues the same collectives in the same order on every rank and derives every
payload from the sending rank, so each rank knows exactly what it must receive; the checks
themselves live in :mod:`evenflow.transports.testing._checks`. In-process runners, and
:func:`~evenflow.transports.testing.check_inprocess_conformance`, are in
:mod:`evenflow.transports.testing.inprocess`.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from evenflow.transports._base import Transport
from evenflow.transports.testing._checks import Check, Options, checks

__all__ = ["GroupMaker", "check_transport"]

#: What a maker returns: this caller's member of a fresh group, or several members of one.
Members: TypeAlias = Transport | Sequence[Transport]
#: A callable that makes a fresh, connected group on every call (see :func:`check_transport`).
GroupMaker: TypeAlias = Callable[[], Members | Awaitable[Members]]

# Longest piece of one failure's message quoted in the summary of several.
_QUOTE_CHARS = 300


@dataclass(frozen=True)
class _Failure:
    order: int
    check: str
    rank: int | None
    error: Exception


async def check_transport(
    make_group: GroupMaker, *, large_bytes: int = 8 << 20, check_timeout: bool = False
) -> None:
    """Run the whole transport contract, each check on a fresh group from ``make_group``.

    ``make_group()`` (a function or a coroutine function, called with no argument) returns
    the members of a new, connected group that this call drives: one transport, where every
    rank runs ``check_transport`` at once in its own process or thread (then every rank calls
    its maker at the same points, as for any collective), or a sequence of transports, all
    driven from this event loop (every member of an in-process group, say). It is called once
    per check (twice for the check of independent groups) and must build new transports each
    time; the suite closes every member after its check.

    Checks, in this order: identity and ordering by group rank; ``all_gather`` and
    ``broadcast`` (from every source) of every supported value type; ``exchange`` with empty
    input, self-sends, uneven and missing routes, a ``large_bytes`` payload (0 skips it) and
    many small payloads; ``exchange_sized`` with empty, uneven and large input and bad
    arguments refused before any data moves; ``RouteError`` and ``EncodeError`` raised
    locally with the group still usable afterwards; 50 mixed operations; close semantics
    (``closed``, every operation raising ``TransportClosedError``, a second ``aclose()``);
    ``async with`` closing on exit; two groups alive at once staying independent when one
    closes; last, with ``check_timeout=True`` (only for a transport with a short timeout:
    rank 0 idles for twice the timeout), a missing peer causing ``TransportTimeoutError``
    and prompt failures afterwards.

    Every check runs even when an earlier one failed. If any failed, raises an
    ``ExceptionGroup`` whose message names the failed checks and holds every failure in the
    order they happened (the first is usually the cause of the rest): an ``AssertionError``
    naming the check, the rank and what differed for a contract violation, or the error the
    transport raised, with a note naming the check. A multi-process maker must give its
    group creation a longer timeout than the transport's, so that a rank whose peer is still
    waiting out a failed check meets it at the next group. Raises ``TypeError`` for a
    transport instance in place of a maker, or a maker that returns something else than
    fresh transports.
    """
    _check_maker(make_group)
    if isinstance(large_bytes, bool) or not isinstance(large_bytes, int) or large_bytes < 0:
        raise ValueError(f"large_bytes must be an integer >= 0, but got {large_bytes!r}.")
    options = Options(large_bytes)
    suite = checks(check_timeout=bool(check_timeout))
    made: list[Transport] = []  # every member so far: a maker must not hand one out twice
    failures: list[_Failure] = []
    order = itertools.count()
    for check in suite:
        try:
            groups = [await _make(make_group, made) for _ in range(check.groups)]
        except TypeError:
            raise
        except Exception as exc:
            # No group, no later check: a rank cannot tell its peers where it stopped.
            exc.add_note(f"make_group failed before the conformance check {check.name!r}.")
            failures.append(_Failure(next(order), check.name, None, exc))
            break
        await _run(check, groups, options, failures, order)
    if failures:
        raise _group_of(failures, len(suite))


def _check_maker(make_group: object) -> None:
    if isinstance(make_group, Transport):
        raise TypeError(
            f"make_group must be a maker of fresh transports, but got the transport "
            f"{make_group!r}; check_transport runs every check on a fresh group, so pass a "
            "function that builds one, e.g. check_transport(lambda: GlooTransport(timeout=5.0))"
            " in each rank, or a function returning every member of a new in-process group."
        )
    if not callable(make_group):
        raise TypeError(
            f"make_group must be a callable that returns a fresh transport (or the members of "
            f"a fresh group) on every call, but got {make_group!r:.80} "
            f"({type(make_group).__name__})."
        )


async def _make(make_group: GroupMaker, made: list[Transport]) -> list[Transport]:
    """Call the maker; its members, checked and sorted by rank."""
    value: object = make_group()
    if inspect.isawaitable(value):
        value = await value
    returned: object = [value] if isinstance(value, Transport) else value
    if (
        isinstance(returned, (str, bytes))
        or not isinstance(returned, Sequence)
        or not returned
        or not all(isinstance(m, Transport) for m in returned)
    ):
        raise TypeError(
            f"make_group must return a Transport or a non-empty sequence of Transports, but "
            f"it returned {value!r:.120}."
        )
    members: list[Transport] = list(returned)
    for member in members:
        if any(member is old for old in made):
            raise TypeError(
                f"make_group returned {member!r}, a transport an earlier check already used "
                "(and closed); it must build new transports on every call, e.g. "
                "lambda: GlooTransport(timeout=5.0) rather than lambda: transport."
            )
    ranks = [m.rank for m in members]
    if len(set(ranks)) != len(ranks) or len({m.num_ranks for m in members}) != 1:
        raise TypeError(
            f"make_group must return members of one group (distinct ranks, one num_ranks), "
            f"but it returned {list(members)!r:.200}."
        )
    made.extend(members)
    return sorted(members, key=lambda m: m.rank)


async def _run(
    check: Check,
    groups: list[list[Transport]],
    options: Options,
    failures: list[_Failure],
    order: itertools.count[int],
) -> None:
    """``check`` on every member this call drives, at once; then close them all."""
    if len({tuple(m.rank for m in g) for g in groups}) != 1:
        shapes = [[m.rank for m in g] for g in groups]
        raise TypeError(
            f"make_group must give this caller the same ranks on every call, but two calls "
            f"gave ranks {shapes}."
        )

    async def member(ranked: tuple[Transport, ...]) -> None:
        try:
            await check.run(*ranked, options)
        except Exception as exc:
            failures.append(_Failure(next(order), check.name, ranked[0].rank, exc))
        finally:
            # Closing at once (not after the slowest member) lets in-process peers of a
            # failed member fail fast instead of waiting for the timeout.
            for transport in ranked:
                try:
                    await transport.aclose()
                except Exception as exc:
                    exc.add_note(f"aclose() raised after the conformance check {check.name!r}.")
                    failures.append(_Failure(next(order), check.name, transport.rank, exc))

    await asyncio.gather(*(member(ranked) for ranked in zip(*groups, strict=True)))


def _group_of(failures: list[_Failure], num_checks: int) -> ExceptionGroup[Exception]:
    failures.sort(key=lambda f: f.order)
    errors = []
    for failure in failures:
        if not (isinstance(failure.error, AssertionError) and str(failure.error).startswith("[")):
            where = "" if failure.rank is None else f" on rank {failure.rank}"
            failure.error.add_note(f"in the conformance check {failure.check!r}{where}")
        errors.append(failure.error)
    failed = list(dict.fromkeys(f.check for f in failures))
    first = failures[0]
    quoted = " ".join(str(first.error).split())[:_QUOTE_CHARS]
    return ExceptionGroup(
        f"{len(failed)} of {num_checks} transport conformance checks failed ("
        f"{', '.join(failed)}), {len(failures)} failure(s) in all; the first, in "
        f"{first.check!r}: {type(first.error).__name__}: {quoted}",
        errors,
    )
