"""torchtitan's dataloader protocol over a balanced loader.

torchtitan's trainer reads its data through a ``BaseDataLoader``: a
``torch.distributed.checkpoint`` ``Stateful`` (``state_dict`` / ``load_state_dict``) whose
``__iter__`` yields ``(input_dict, labels)`` pairs, one per microbatch, and pulls
``gradient_accumulation_steps`` of them per optimizer step. Its checkpointer saves the loader
with DCP, so every data-parallel rank keeps its state under a key of its own
(``dp_rank_<k>``) beside the ``world_size`` it was saved with.

:class:`TitanLoader` speaks that protocol:

* ``input_dict`` is ``{"input": token ids [1, T], "positions": position ids [1, T]}``: the
  positions restart at every sample, which is what torchtitan's block-causal (per-document)
  attention masks are built from;
* ``labels`` are torchtitan's *shifted* targets (``labels[t]`` is the token after ``input[t]``),
  -100 where nothing is trained: at every sample's last token (its next token starts another
  sample), on masked prompts, and at the row's end. torchtitan counts them (``labels !=
  -100``) and sums the count over the data-parallel ranks: that sum is
  ``loader.last_loss_tokens.world``, the loss divisor evenflow keeps independent of the plan;
* one optimizer step is one balanced loader step (``bins_per_rank = bins_per_microbatch *
  gradient_accumulation_steps``), and epochs follow each other (``set_epoch`` at the top of
  each) for as long as torchtitan asks for steps (``infinite=True``, its default for
  training);
* ``state_dict()`` is ``{"dp_rank_<k>": <the loader's plain-data state>, "world_size": n}``.

torchtitan is not a dependency: when it is importable, ``TitanLoader`` is registered as a
virtual subclass of its ``BaseDataLoader``; the protocol itself needs only torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from evenflow.engine._validate import check_int
from evenflow.engine.errors import ResumeError
from evenflow.engine.integrations._common import LoaderView

__all__ = ["TitanLoader", "titan_microbatch"]

IGNORE_INDEX = -100


def titan_microbatch(packed: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``(input_dict, labels)`` in torchtitan's layout from one packed row of
    ``default_pack_fn``'s layout (the Hugging Face one, whose labels the model shifts)."""
    labels = packed["labels"]
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return {"input": packed["input_ids"], "positions": packed["position_ids"]}, shifted


class TitanLoader:
    """A torchtitan ``BaseDataLoader`` over ``loader`` (see the module).

    ``dp_rank`` / ``dp_world_size``: this rank's data-parallel position (the keys of its
    state). ``bins_per_microbatch``: packed bins merged into each microbatch row.
    ``infinite``: go on with the next epoch when one ends (torchtitan trains by steps).
    """

    def __init__(
        self,
        loader: Any,
        *,
        dp_rank: int,
        dp_world_size: int,
        bins_per_microbatch: int = 1,
        infinite: bool = True,
    ) -> None:
        self.dp_rank = check_int("dp_rank", dp_rank)
        self.dp_world_size = check_int("dp_world_size", dp_world_size, minimum=1)
        if self.dp_rank >= self.dp_world_size:
            raise ValueError(
                f"dp_rank must be < dp_world_size={dp_world_size}, but got dp_rank={dp_rank}."
            )
        self._view = LoaderView(loader, bins_per_microbatch=bins_per_microbatch)
        self._infinite = bool(infinite)
        self._rank_id = f"dp_rank_{self.dp_rank}"

    @property
    def view(self) -> LoaderView:
        return self._view

    @property
    def loader(self) -> Any:
        return self._view.loader

    def set_epoch(self, epoch: int) -> None:
        self._view.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        while True:
            count = 0
            for packed in self._view:
                count += 1
                yield titan_microbatch(packed)
            if not self._infinite:
                return
            if count == 0 and self._view.loader.step == 0:
                return  # an epoch without a single step: the data is too small to loop on

    def state_dict(self) -> dict[str, Any]:
        return {self._rank_id: self._view.state_dict(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan's convention: an empty state is a fresh start
            return
        if self._rank_id not in state_dict:
            raise ResumeError(
                f"The dataloader state has no entry for {self._rank_id!r} (it has "
                f"{sorted(state_dict)}): it was saved by another data-parallel layout. Resume "
                "with the same number of data-parallel ranks."
            )
        saved = state_dict.get("world_size")
        if saved != self.dp_world_size:
            raise ResumeError(
                f"The dataloader state was saved with world_size={saved!r} data-parallel "
                f"ranks; this run has {self.dp_world_size}. Resume with the same layout."
            )
        self._view.load_state_dict(state_dict[self._rank_id])

    def close(self) -> None:
        self._view.loader.close()


def _register() -> None:
    try:
        from torchtitan.components.dataloader import BaseDataLoader
    except Exception:  # torchtitan absent or not importable here: the protocol still holds
        return
    BaseDataLoader.register(TitanLoader)


_register()
