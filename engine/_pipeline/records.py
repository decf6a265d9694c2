"""The feature records a step carries only where their feature is on.

A :class:`~evenflow.engine._pipeline.step.StepState` holds what every step has (its samples,
plan, routes, status and error). What a feature adds lives in a record of its own, attached to
the step by the stage that owns the feature and ``None`` everywhere else, so that a stage which
does not care about a feature never sees its flags:

* :class:`WindowShare`: a balance window's samples, wire frames and metadata rounds, one record
  shared by the window's steps (attached by the window's plan stage);
* :class:`PassEdge`: a step at an edge of a windowed pass, replayed before a restored pass's
  first delivered step, or ending the pass in the middle of its window;
* :class:`LossCount`: the loss targets known for the step, on this rank, its balance group and
  the world (attached by the pack stage when this rank's count is known);
* :class:`DeviceSlot`: the step's place under ``device_prefetch_depth`` (attached by the pack
  stage when batches are staged on a device).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceSlot", "LossCount", "PassEdge", "WindowShare"]


@dataclass(eq=False, slots=True)
class WindowShare:
    """What the steps of one balance window share, by the step that read it.

    A step's plan may name samples of any step of its window, so the reading rank keeps each of
    its samples (and wire frames) here until the step that trains it has sent or packed it
    (:meth:`forget`); ``messages`` holds every rank's metadata message of each gathered step.
    """

    samples: dict[int, list[Any]]
    prepared: dict[int, list[Any]] | None  # payload mode only
    messages: dict[int, list[dict[str, Any]]]

    def forget(self, groups: Iterable[list[tuple[int, int, int]]], rank: int) -> None:
        """Drop this rank's samples and frames among the key lists ``groups``: their training
        step has sent or packed them, so the window no longer holds them."""
        for keys in groups:
            for key in keys:
                if key[0] != rank:
                    continue
                for held in (self.samples, self.prepared):
                    row = None if held is None else held.get(key[1])
                    if row is not None:  # (a step without frames: shared-dataset mode, one rank)
                        row[key[2]] = None


@dataclass(eq=False, slots=True)
class PassEdge:
    """A step of a balance window at an edge of its pass.

    ``skip``: delivered before the restore this pass started from; it is gathered and planned
    again (identically), takes its exchange and settle turns without moving or packing data,
    and is never delivered. ``final_round``: the metadata round of this step ended the pass
    in the middle of its window; after the window's last settle, a ``final`` round confirms
    the window's steps.
    """

    skip: bool = False
    final_round: bool = False


@dataclass(eq=False, slots=True)
class LossCount:
    """The loss targets of one step: this rank's planned batch (known when the pack stage
    attaches the record), its balance group (from the next metadata round's reports) and the
    world (from the world round; ``None`` until known)."""

    rank: int
    group: int | None = None
    world: int | None = None


@dataclass(eq=False, slots=True)
class DeviceSlot:
    """A step's place under the device-prefetch bound. ``now``: staged on the device by the
    pack stage (else it waits on the host, pinned, for the h2d stage); ``held``: it holds one
    of the pipeline's device slots until it is delivered (or fails)."""

    now: bool
    held: bool = False
