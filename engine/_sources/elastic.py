"""Elastic resume: the rest of an interrupted epoch dealt to a different number of ranks.

A :class:`~evenflow.engine.DatasetSource` packs an epoch into *units* (``bins_per_rank`` bins
each) from the lengths, the seed and the epoch alone: the units, and their order, do not
depend on the number of ranks. Only the *dealing* does: which rank reads which unit as which
step. That makes its position global. After every rank delivered ``step`` steps, the consumed
units are exactly a prefix of the epoch's units, ``[0, consumed)``; nothing about it is
private to a rank.

A :class:`Dealing` describes how units are dealt from some step on: from unit ``base_unit``,
step ``base_step + k`` of rank ``r`` is unit ``base_unit + k * num_ranks + r``. An epoch starts
with ``Dealing(0, 0, num_ranks)``; a restore onto ``M`` ranks at step ``s`` continues with
``Dealing(consumed, s, M)``, so every unit not yet consumed is dealt exactly once, no consumed
one again, and step numbers continue where they stopped. What the epoch then leaves unread is
the packer's remainder plus the last ``(num_units - consumed) % M`` units. The next epoch is
dealt to the ranks the source was built for.

A source whose position is per rank (a stream each rank reads on its own, such as an
``IterableSource``) has no such prefix: its ranks' positions cannot be merged or re-split, so
it restores only onto the ranks that saved it, and :func:`not_elastic_reason` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evenflow.engine.errors import ResumeError

__all__ = ["Dealing", "has_global_position", "not_elastic_reason"]


@dataclass(frozen=True)
class Dealing:
    """Units ``base_unit, base_unit + 1, ...`` dealt round-robin to ``num_ranks`` ranks as
    their steps ``base_step, base_step + 1, ...``."""

    base_unit: int
    base_step: int
    num_ranks: int

    def unit(self, step: int, rank: int) -> int:
        """The unit rank ``rank`` reads as its step ``step`` (``step >= base_step``)."""
        return self.base_unit + (step - self.base_step) * self.num_ranks + rank

    def num_steps(self, num_units: int) -> int:
        """Steps per rank in the epoch (the steps before ``base_step`` included)."""
        return self.base_step + max(0, num_units - self.base_unit) // self.num_ranks

    def end_unit(self, num_units: int) -> int:
        """The first unit the epoch leaves unread (every later one is unread too)."""
        return self.consumed(self.num_steps(num_units))

    def consumed(self, step: int) -> int:
        """Units consumed once every rank has delivered ``step`` steps."""
        return self.base_unit + (step - self.base_step) * self.num_ranks

    def rebase(self, step: int, num_ranks: int) -> Dealing:
        """The dealing that continues this one at ``step`` on ``num_ranks`` ranks."""
        if num_ranks == self.num_ranks:
            return self  # the same ranks: the same dealing, bitwise
        return Dealing(self.consumed(step), step, num_ranks)

    def to_state(self) -> dict[str, int]:
        return {
            "base_unit": self.base_unit,
            "base_step": self.base_step,
            "num_ranks": self.num_ranks,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], num_units: int) -> Dealing:
        """Read a saved dealing, checking it against the epoch's ``num_units``."""
        values = []
        for name in ("base_unit", "base_step", "num_ranks"):
            value = state.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ResumeError(f"state[{name!r}] must be a non-negative integer, got {value!r}.")
            values.append(value)
        dealing = cls(*values)
        if dealing.num_ranks < 1 or dealing.base_unit > num_units:
            raise ResumeError(
                f"The saved dealing {dealing.to_state()} does not fit an epoch of {num_units} "
                "units; the state belongs to another dataset or packing."
            )
        return dealing


def has_global_position(source: Any) -> bool:
    """Whether ``source``'s state is the same on every data-parallel rank at the same step
    (it declares ``global_position = True``), so it can be restored onto other ranks."""
    return getattr(source, "global_position", False) is True


def not_elastic_reason(source: Any) -> str:
    """Why ``source`` cannot be restored onto a different set of ranks."""
    name = type(source).__name__
    if source is None:
        return "this rank reads no source"
    if callable(getattr(source, "state_dict", None)):
        return (
            f"its source ({name}) keeps a position of its own on each rank (a stream read "
            "rank by rank), which cannot be merged and re-split across a different number "
            "of ranks; only a source with a global position (DatasetSource) can"
        )
    return (
        f"its source ({name}) has no state: it is rewound by re-reading each rank's own "
        "steps, which exist only for the ranks that saved them; use DatasetSource for an "
        "elastic restore"
    )
