"""The saved loader position (``BalancedLoader.state_dict``): its layout, checks and restore.

A state describes the *consumed* position only: the epoch, the number of steps delivered, and
the source's own state as it was right after the last delivered step was read. The pipeline
captures that source state per step, as the step is read, and carries it with the step, so
prefetched (speculative) steps never leak into a checkpoint.

**Balance windows.** With ``balance_window = W > 1`` a sample may train in another step of its
window than the one that read it, so the source state saved at step ``step`` is the one at
``read_from``: :func:`window_first` (``step - step % W``, the first step of the window that holds
the next step) while that window is open, not after the last delivered step. A restore reads
the window again from there, plans it again (identically: a plan is a pure function of the
gathered steps) and skips the steps before ``step``. A window the pass ended early (at
``max_steps``, or at the source's end) is closed once its steps are delivered: then
``read_from`` is ``step`` itself, so a run extended to a larger ``max_steps`` does not plan the
closed window's delivered steps again with later ones (which would deliver some samples twice
and others never), and the state restores onto any number of ranks. A global position saved
inside an open window (``read_from < step``) restores only onto as many ranks.

**Layout.** Every rank of a data-parallel world saves a dict of the same shape, made so that
``torch.distributed.checkpoint`` (which writes a key saved by several ranks only once, from
one of them) can never mix ranks' data::

    format, version, epoch, step, identity, digest   the same on every rank at the same step
    position                                          a source with a global position: its
                                                      state, the same on every rank
    ranks: {"<process rank>": entry}                  any other source: this rank's own
                                                      entry, under a key no other rank uses

The shared fields hold only what every rank computes alike (the step a synchronous loop is
at, the configuration that must match); ``digest`` covers them, so a checkpoint that merged
ranks saved at different steps is refused. A per-rank ``entry`` names its rank and group and
carries its own digest, so an entry restored on the wrong rank, or merged from several, is
refused too. Nested, free-form data (the sources' states) is stored as one opaque value,
encoded with the wire format (no pickle), so the checkpoint's keys never depend on it.

**Restore.** A stateful source gets its state back through ``load_state_dict``; a source
without state is rewound by re-reading and discarding the consumed steps (slower, but exact
for deterministic sources). A source with a global position restores onto any ranks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from evenflow.engine._sources.elastic import has_global_position, not_elastic_reason
from evenflow.engine.errors import LoaderStateError, ResumeError
from evenflow.transports import Transport, decode, encode
from evenflow.transports.errors import EncodeError, WireFormatError

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "Restore",
    "describe_difference",
    "earlier_epoch_error",
    "loader_state",
    "process_rank",
    "read_state",
    "restore_source",
    "window_first",
]

#: What ``BalancedLoader.state_dict()`` writes, and all that :func:`read_state` accepts.
STATE_FORMAT = "evenflow.loader"
STATE_VERSION = 3

_SHARED = ("format", "version", "epoch", "step", "identity", "digest")


@dataclass(frozen=True)
class Restore:
    """What a loader restores: its epoch and step, the step its source state belongs to (the
    first one it reads again), and that state (or None)."""

    epoch: int
    step: int
    read_from: int
    source: Any


def loader_state(
    *,
    epoch: int,
    step: int,
    identity: dict[str, Any],
    source: Any,
    source_state: Any,
    process_rank: int | None,
    group_rank: int,
    group: list[int],
    read_from: int | None = None,
) -> dict[str, Any]:
    """The state of one rank. ``process_rank`` None: a rank without a source (a
    model-parallel follower), which writes only the shared fields. ``read_from``: the step
    ``source_state`` belongs to (``step`` when None; earlier inside an open balance window)."""
    read_from = step if read_from is None else read_from
    text = _identity_text(identity)
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "epoch": epoch,
        "step": step,
        "identity": text,
        "digest": _digest(epoch, step, text),
    }
    if process_rank is None:
        return state
    if has_global_position(source):
        # The position repeats the step, so a checkpoint that kept it from one rank and the
        # shared fields from another (ranks saved at different steps) is caught.
        state["position"] = _encode(
            {
                "epoch": epoch,
                "step": step,
                "read_from": read_from,
                "num_ranks": getattr(source, "num_ranks", None),
                "state": source_state,
            }
        )
        return state
    entry: dict[str, Any] = {
        "rank": group_rank,
        "group": list(group),
        "epoch": epoch,
        "step": step,
        "read_from": read_from,
        "source": None if source_state is None else _encode(source_state),
        "stateful": callable(getattr(source, "state_dict", None)),
    }
    entry["digest"] = _entry_digest(entry)
    state["ranks"] = {str(process_rank): entry}
    return state


def read_state(
    state: Any,
    *,
    identity: dict[str, Any],
    source: Any,
    process_rank: int | None,
    group_rank: int,
    group: list[int],
    max_steps: int | None,
    window: int = 1,
) -> Restore:
    """Check ``state`` against this rank and return what to restore; ``ResumeError`` names
    what is wrong. ``process_rank`` None: a rank without a source. ``window``: the balance
    window; a global position saved inside a window restores only onto as many ranks."""
    _check_shared(state)
    saved = json.loads(state["identity"])
    if saved != json.loads(_identity_text(identity)):
        raise ResumeError(
            "The state was saved with a different configuration: "
            + describe_difference(saved, identity)
        )
    epoch, step = state["epoch"], state["step"]
    if max_steps is not None and step > max_steps:
        raise ResumeError(
            f"The state is at step {step}, beyond max_steps={max_steps}; raise "
            "LoaderConfig.max_steps to at least the saved step."
        )
    if process_rank is None:
        return Restore(epoch, step, step, None)
    ranks = state.get("ranks")
    if has_global_position(source):
        if "position" not in state:
            raise ResumeError(
                f"The state was saved from a source with a per-rank position, but this "
                f"loader's source ({type(source).__name__}) has a global one; restore it with "
                "the kind of source that saved it."
            )
        position = decode_state(state["position"], "state['position']")
        if not isinstance(position, dict) or (position.get("epoch"), position.get("step")) != (
            epoch,
            step,
        ):
            saved_at = position.get("step") if isinstance(position, dict) else None
            raise ResumeError(
                f"The state's source position is at step {saved_at!r} but its shared fields "
                f"say epoch {epoch} step {step}: the ranks were saved at different steps and "
                "the checkpoint (torch.distributed.checkpoint writes a key saved by several "
                "ranks once) kept parts of different ranks' states. Save every rank at the "
                "same step."
            )
        read_from = _read_from(position, step, window)
        saved_ranks = position.get("num_ranks")
        ranks = getattr(source, "num_ranks", None)
        if saved_ranks != ranks and read_from != step:
            raise ResumeError(
                f"The state was saved at step {step}, inside a balance window of {window} "
                f"steps (it began at step {read_from}), on {saved_ranks} ranks; this "
                f"source deals to {ranks}. The window's delivered steps hold samples planned "
                "across the whole window, so only the same ranks can finish it. Restore onto "
                f"{saved_ranks} ranks, or save at a window boundary (a step that is a multiple "
                f"of {window}, or the end of the pass) to change the number of ranks."
            )
        return Restore(epoch, step, read_from, position.get("state"))
    if not isinstance(ranks, dict):
        raise ResumeError(
            "The state holds a global position (saved from a DatasetSource) but this "
            f"loader's source is a {type(source).__name__}; restore it with the kind of source "
            "that saved it."
        )
    entry = ranks.get(str(process_rank))
    if entry is None:
        raise ResumeError(
            f"The state holds entries for ranks {sorted(ranks, key=_rank_order)} but none for "
            f"this rank ({process_rank}), so it was saved on other ranks. It cannot be "
            f"restored here because {not_elastic_reason(source)}."
        )
    _check_entry(entry, process_rank)
    if entry["rank"] != group_rank or list(entry["group"]) != list(group):
        raise ResumeError(
            f"The state of rank {process_rank} was saved as group rank {entry['rank']} of the "
            f"group {list(entry['group'])}, but this loader is group rank {group_rank} of "
            f"{list(group)}. It cannot be restored into another group layout because "
            f"{not_elastic_reason(source)}."
        )
    if (entry["epoch"], entry["step"]) != (epoch, step):
        raise ResumeError(
            f"The state of rank {process_rank} is at epoch {entry['epoch']} step "
            f"{entry['step']}, but its shared fields say epoch {epoch} step {step}. Either the "
            "ranks were saved at different steps and the checkpoint kept one rank's shared "
            "fields (save every rank at the same step), or the checkpoint has no entry for "
            "this rank and a partial load (torch.distributed.checkpoint's "
            "DefaultLoadPlanner(allow_partial_load=True)) left this loader's own in place: the "
            "state was then saved on other ranks, and cannot be restored here because "
            f"{not_elastic_reason(source)}."
        )
    read_from = _read_from(entry, step, window)
    source_state = entry["source"]
    if step and source_state is None and entry["stateful"]:
        raise ResumeError("The state has no source state although its source was stateful.")
    decoded = None if source_state is None else decode_state(source_state, "the source state")
    return Restore(epoch, step, read_from, decoded)


def describe_difference(saved: Any, current: dict[str, Any], path: str = "") -> str:
    """The first field (dotted path) whose value differs, as ``a.b was X and is now Y.``"""
    if not isinstance(saved, dict):
        return "the saved identity is unavailable."
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            if a != b:
                return describe_difference(a, b, f"{path}{key}.")
        elif a != b:
            return f"{path}{key} was {a!r} and is now {b!r}."
    return "they differ."


def window_first(step: int, window: int) -> int:
    """The first step of the balance window of ``window`` steps that holds step ``step``."""
    return step - step % window


def restore_source(source: Any, steps: int, source_state: Any) -> Iterator[Any] | None:
    """Put ``source`` at the position right after ``steps`` consumed steps (with a balance
    window: ``steps`` is the window's first step, and ``source_state`` the state there).

    Returns ``None`` when the source restored itself (the pipeline then calls ``iter(source)``
    as usual), or the iterator that was fast-forwarded past the consumed steps.
    """
    load = getattr(source, "load_state_dict", None)
    if source_state is not None and callable(load):
        load(source_state)
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


# -- checks ------------------------------------------------------------------------------------


def _check_shared(state: Any) -> None:
    if not isinstance(state, dict):
        raise ResumeError(
            f"A loader state must be the dict returned by state_dict(), but got "
            f"{type(state).__name__}."
        )
    # Format and version first: an older state lacks newer fields.
    if "format" in state and state["format"] != STATE_FORMAT:
        raise ResumeError(f"The state has format {state['format']!r}, expected {STATE_FORMAT!r}.")
    if "version" in state and state["version"] != STATE_VERSION:
        raise ResumeError(
            f"The state has version {state['version']!r}; this evenflow reads "
            f"version {STATE_VERSION}."
        )
    missing = [k for k in _SHARED if k not in state]
    if missing:
        raise ResumeError(
            f"The loader state is missing {missing}; it was not produced by "
            "BalancedLoader.state_dict()."
        )
    for name in ("epoch", "step"):
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ResumeError(f"state[{name!r}] must be a non-negative integer, got {value!r}.")
    if not isinstance(state["identity"], str):
        raise ResumeError("state['identity'] must be the text state_dict() wrote.")
    if state["digest"] != _digest(state["epoch"], state["step"], state["identity"]):
        raise ResumeError(
            "The loader state's shared fields (epoch, step, identity) do not belong together: "
            "a checkpoint merged the states of ranks saved at different steps or with "
            "different configurations (torch.distributed.checkpoint writes a key saved by "
            "several ranks once). Save every rank at the same step, with the same "
            "configuration."
        )


def _read_from(saved: dict[str, Any], step: int, window: int) -> int:
    """The step a saved source state belongs to: ``step``, or (inside a balance window of
    ``window`` steps) an earlier step of the window."""
    read_from = saved.get("read_from")
    if (
        isinstance(read_from, bool)
        or not isinstance(read_from, int)
        or not step - window < read_from <= step
    ):
        raise ResumeError(
            f"The state reads its source again from step {read_from!r} to restore step "
            f"{step}, but a balance window of {window} steps allows steps "
            f"{max(0, step - window + 1)} to {step}; the state was saved with another "
            "balance_window, or is damaged."
        )
    return read_from


def _check_entry(entry: Any, process_rank: int) -> None:
    fields = ("rank", "group", "epoch", "step", "read_from", "source", "stateful", "digest")
    if not isinstance(entry, dict) or any(k not in entry for k in fields):
        raise ResumeError(
            f"The entry of rank {process_rank} in the state is not one state_dict() wrote."
        )
    if entry["digest"] != _entry_digest(entry):
        raise ResumeError(
            f"The entry of rank {process_rank} in the state mixes values saved by different "
            "ranks: a per-rank state was saved under a key shared by several ranks, and the "
            "checkpoint kept some values from each. Save the loader itself (or "
            "loader.state_dict() whole) so that every rank's entry has its own key."
        )


# -- encoding ----------------------------------------------------------------------------------


def _identity_text(identity: dict[str, Any]) -> str:
    return json.dumps(identity, sort_keys=True, default=str)


def _digest(epoch: int, step: int, identity: str) -> str:
    text = json.dumps([epoch, step, identity])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _entry_digest(entry: dict[str, Any]) -> str:
    fields = [
        entry[k] for k in ("rank", "group", "epoch", "step", "read_from", "source", "stateful")
    ]
    packed = msgpack.packb([list(f) if isinstance(f, tuple) else f for f in fields])
    return hashlib.sha256(packed).hexdigest()[:24]


def _encode(value: Any) -> bytes:
    try:
        return bytes(encode(value))
    except EncodeError as exc:
        raise ResumeError(
            f"The source's state_dict() returned a value the loader state cannot hold: {exc} "
            "Return plain data (str-keyed dicts, lists, numbers, strings), numpy arrays or "
            "tensors."
        ) from exc


def decode_state(raw: Any, what: str) -> Any:
    """Bytes of the loader state written with the wire format, decoded; ``what`` names the
    entry in the errors (:class:`ResumeError` for a wrong type or damaged bytes)."""
    if not isinstance(raw, (bytes, bytearray)):
        raise ResumeError(f"{what} must be the bytes state_dict() wrote, got {type(raw).__name__}.")
    try:
        return decode(bytearray(raw))  # a private, writable copy: views stay valid
    except WireFormatError as exc:
        raise ResumeError(f"{what} in the loader state is damaged: {exc}") from exc


def _rank_order(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isdigit() else (1 << 62, key)


def earlier_epoch_error(epoch: int, restored_epoch: int, restored_step: int) -> LoaderStateError:
    """The refusal of ``set_epoch(epoch)`` right after restoring a state of a later epoch (the
    same rule on every rank of a model-parallel group: constructor and follower)."""
    return LoaderStateError(
        f"set_epoch({epoch}) after load_state_dict() of a state in epoch {restored_epoch} "
        f"(step {restored_step}) would train epochs the run has already trained. Call "
        f"set_epoch({restored_epoch}) to continue where the state left off (or start the "
        "epoch loop there), or do not restore."
    )


def process_rank(transport: Transport) -> int:
    """The key of this rank's entry in a state: the torch.distributed rank when a world is
    initialised (unique even when each process runs a loader of its own), else the
    transport's global rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(transport.global_ranks[transport.rank])
