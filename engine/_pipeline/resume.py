"""Checking and applying a saved loader position (``BalancedLoader.load_state_dict``).

A state describes the *consumed* position only: the epoch, the number of steps delivered
(``step``), and the source's own ``state_dict()`` at ``window_first``, the first step of the
balance window that holds step ``step`` (``step - step % balance_window``): with
``balance_window`` 1 that is the state right after the last delivered step was read. The
pipeline captures the source state per step, as the step is read, and carries it with the
step, so prefetched (speculative) steps never leak into a checkpoint.

A restore in the middle of a window reads the window again from ``window_first`` (its samples
may train in any of its steps, so all of them are needed), plans it again — identically, since
a plan is a pure function of the gathered steps — and skips the steps before ``step``: they
are neither exchanged nor delivered again. ``window_first`` is written for readers of the
state; it is implied by ``step`` and the configuration (whose fingerprint the state carries),
and a state without it (written before balance windows existed) means ``step``.

Restoring a stateful source calls its ``load_state_dict``; a source without state is rewound by
re-reading and discarding the consumed steps (slower, but exact for deterministic sources).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from evenflow.engine.errors import ResumeError

__all__ = ["STATE_FORMAT", "STATE_VERSION", "restore_source", "validate_state", "window_first"]

#: What ``BalancedLoader.state_dict()`` writes, and all that :func:`validate_state` accepts.
STATE_FORMAT = "evenflow.loader"
STATE_VERSION = 1

_REQUIRED = ("format", "version", "epoch", "step", "source", "rank", "group", "fingerprint")


def window_first(step: int, window: int) -> int:
    """The first step of the balance window of ``window`` steps that holds step ``step``."""
    return step - step % window


def validate_state(state: Any, loader: Any) -> None:
    """Raise ``ResumeError`` naming what differs between ``state`` and ``loader``."""
    if not isinstance(state, dict):
        raise ResumeError(
            f"A loader state must be the dict returned by state_dict(), but got "
            f"{type(state).__name__}."
        )
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ResumeError(
            f"The loader state is missing {missing}; it was not produced by "
            "BalancedLoader.state_dict()."
        )
    if state["format"] != STATE_FORMAT:
        raise ResumeError(f"The state has format {state['format']!r}, expected {STATE_FORMAT!r}.")
    if state["version"] != STATE_VERSION:
        raise ResumeError(
            f"The state has version {state['version']!r}; this evenflow reads "
            f"version {STATE_VERSION}."
        )
    for name in ("epoch", "step"):
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ResumeError(f"state[{name!r}] must be a non-negative integer, got {value!r}.")
    transport = loader.transport
    if state["rank"] != transport.rank:
        raise ResumeError(
            f"The state was saved by group rank {state['rank']!r}, but this loader is group "
            f"rank {transport.rank}. Restore each rank from its own state."
        )
    if list(state["group"]) != list(transport.global_ranks):
        raise ResumeError(
            f"The state was saved in a group of ranks {list(state['group'])}, but this loader's "
            f"group is {list(transport.global_ranks)}; the group layout must not change."
        )
    if state["fingerprint"] != loader.fingerprint(for_resume=True):
        raise ResumeError(
            "The state was saved with a different configuration: "
            + _describe_difference(state.get("identity"), loader.identity(for_resume=True))
        )
    limit = loader.config.max_steps
    if limit is not None and state["step"] > limit:
        raise ResumeError(f"The state is at step {state['step']}, beyond max_steps={limit}.")
    first = window_first(state["step"], loader.config.balance_window)
    if state.get("window_first", first) != first:
        raise ResumeError(
            f"state['window_first'] is {state['window_first']!r}, but step {state['step']} "
            f"lies in the balance window that starts at step {first} "
            f"(balance_window={loader.config.balance_window}); the state was altered."
        )
    if first and state["source"] is None and state.get("source_stateful"):
        raise ResumeError("The state has no source state although its source was stateful.")


def _describe_difference(saved: Any, current: dict[str, Any], path: str = "") -> str:
    if not isinstance(saved, dict):
        return "the saved identity is unavailable (fingerprints differ)."
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            if a != b:
                return _describe_difference(a, b, f"{path}{key}.")
        elif a != b:
            return f"{path}{key} was {a!r} and is now {b!r}."
    return "fingerprints differ."


def restore_source(source: Any, state: dict[str, Any]) -> Iterator[Any] | None:
    """Put ``source`` at ``state``'s ``window_first`` (see the module docstring).

    Returns ``None`` when the source restored itself (the pipeline then calls ``iter(source)``
    as usual), or the iterator that was fast-forwarded past the steps before it.
    """
    steps = int(state.get("window_first", state["step"]))
    load = getattr(source, "load_state_dict", None)
    if state["source"] is not None and callable(load):
        load(state["source"])
        return None
    if steps == 0:
        return None
    if not hasattr(source, "__iter__"):
        raise ResumeError(
            "An async source without state_dict()/load_state_dict() cannot be rewound; give "
            "it those methods to resume it."
        )
    # No source state: rewind by reading and discarding the consumed steps (slower, exact for
    # deterministic sources).
    iterator: Iterator[Any] = iter(source)
    for done in range(steps):
        try:
            next(iterator)
        except StopIteration:
            raise ResumeError(
                f"The source ended after {done} steps while rewinding to step {steps}."
            ) from None
    return iterator
