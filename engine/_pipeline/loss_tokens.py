"""Loss-token accounting: how many loss targets one step holds on this rank, in its balance
group and in the whole data-parallel world.

Balancing moves samples between the ranks of a group, so the number of loss targets a rank
trains on changes with the plan. A loop that averages its loss per rank (``loss.mean()`` on
every rank, then gradient averaging) weights each token by ``1 / (its rank's tokens)``, which
changes with the plan: balancing on and off would train different models. The plan-free
objective is the mean over every loss target of the step in the whole world,
``sum(token losses) / world``, and that needs the world's count before the backward pass.

How the three totals of a step are found, with no collective beyond those the pipeline runs
anyway (and the world round across groups):

* ``rank``: when every sample's count rides in the metadata round
  (``SampleMetadata.loss_tokens``, filled in by the default pack's
  :func:`~evenflow.engine._pipeline.pack.with_loss_tokens`), from the plan; otherwise, with
  the default pack, by counting the packed labels (samples read after planning, as in
  shared-dataset mode, are only seen there);
* ``group``: each rank reports its ``rank`` total for step ``s`` in the metadata round of
  ``s + 1``, which every rank holds before step ``s`` is delivered: the sum of the reports;
* ``world``: the sum of every rank's ``rank`` total in the world round
  (:mod:`evenflow.engine._pipeline.world_round`); with one balance group it is ``group``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._pipeline.records import LossCount
from evenflow.engine._plan import Plan
from evenflow.engine._validate import check_number

__all__ = ["LossTokens", "planned_loss_count", "rank_loss_tokens", "step_loss_tokens"]


@dataclass(frozen=True, slots=True)
class LossTokens:
    """The loss targets of one delivered step (``loader.last_loss_tokens``).

    ``rank``: what this rank's batch trains on (after balancing); ``group``: the sum over its
    balance group (the same on every rank of the group, whatever the plan); ``world``: the sum
    over every data-parallel rank of the world (the same on every rank of the world).

    The recipe that makes a step's update independent of the plan: compute each microbatch's
    *summed* token loss, and scale it by :meth:`loss_scale` before ``backward()``::

        # DDP (averages gradients over its world_size ranks):
        (summed_loss * tokens.loss_scale(world_size)).backward()   # = * world_size / world
        # FSDP2 after model.set_gradient_divide_factor(1.0) (gradients are summed):
        (summed_loss * tokens.loss_scale(1.0)).backward()          # = / world

    The gradient is then that of ``sum(token losses over the world) / world``, the true mean.
    """

    step: int
    rank: int
    group: int
    world: int

    def loss_scale(self, divide_factor: float) -> float:
        """Factor for a summed token loss, given what the gradient reduction divides by
        (DDP: its world size; FSDP2: its gradient divide factor). ``0.0`` when the world has
        no loss target this step (the loss is then zero, and so is every gradient)."""
        factor = check_number("divide_factor", divide_factor, minimum=0.0, strict_minimum=True)
        return factor / self.world if self.world else 0.0

    def to_dict(self) -> dict[str, int]:
        return {"step": self.step, "rank": self.rank, "group": self.group, "world": self.world}


def _loss_column(message: dict[str, Any]) -> np.ndarray | None:
    loss = message.get("loss")
    return None if loss is None else np.asarray(loss, dtype=np.int64)


def rank_loss_tokens(
    messages: Mapping[int, Sequence[dict[str, Any]]], plan: Plan, rank: int
) -> int | None:
    """The loss targets that group rank ``rank`` trains on under ``plan``.

    A plan slot names its sample by ``(source_rank, step, index)``; the sample's count is row
    ``index`` of the ``source_rank``'s message of that step (``messages[step]``: every rank's
    message of the step; a plan of a balance window names samples of several steps). ``None``
    when any rank's samples lack a count.
    """
    layout = plan.layout
    start, end = layout.rank_slots(rank)
    fields = layout.key_fields[start:end]
    total = 0
    for step, step_messages in messages.items():
        columns = [_loss_column(m) for m in step_messages]
        if any(c is None for c in columns):
            return None
        mine = fields[fields[:, 1] == step]
        if not len(mine):
            continue
        counts = np.fromiter((len(c) for c in columns if c is not None), dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        flat = np.concatenate([c for c in columns if c is not None] or [np.zeros(0, np.int64)])
        total += int(flat[offsets[mine[:, 0]] + mine[:, 2]].sum())
    return total


def planned_loss_count(
    messages: Mapping[int, Sequence[dict[str, Any]]], plan: Plan, rank: int
) -> LossCount | None:
    """The pack stage's loss accounting: the record of a step whose count
    :func:`rank_loss_tokens` knows (``None`` otherwise)."""
    count = rank_loss_tokens(messages, plan, rank)
    return None if count is None else LossCount(count)


def step_loss_tokens(step: int, count: LossCount | None, *, world_round: bool) -> LossTokens | None:
    """The step's ``LossTokens``, or ``None`` when any total is unknown (``world_round``: the
    world spans several balance groups, whose total the world round found; else the world is
    the group)."""
    if count is None:
        return None
    world = count.world if world_round else count.group
    if count.group is None or world is None:
        return None
    return LossTokens(step=step, rank=count.rank, group=count.group, world=world)
