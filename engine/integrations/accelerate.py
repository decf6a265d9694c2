"""Accelerate without the Trainer: a loader that ``prepare`` leaves alone and checkpoints carry.

:func:`prepare_loader` builds the loader of this process from the ``Accelerator``'s own state
(process index, number of processes, ``gradient_accumulation_steps``) and registers it with
``accelerator.register_for_checkpointing``, so ``accelerator.save_state`` stores its position
and ``accelerator.load_state`` restores it exactly. What it returns is a
:class:`~evenflow.engine.integrations.LoaderView`, not a ``torch.utils.data.DataLoader``:
``accelerator.prepare`` returns such an object unchanged, so it can never re-shard what the
loader already assigned to each rank (a ``DataLoader`` with a rank-aware batch sampler would be
wrapped in ``BatchSamplerShard`` and lose most of its samples). :func:`prepare_loader` refuses
a ``DataLoader`` for the same reason.

The loss recipe (the world's mean token loss, the same with balancing on and off)::

    out = model(**batch)  # the batch carries use_cache=False and num_items_in_batch
    accelerator.backward(out.loss * train.loss_scale)

``loss_scale`` is ``num_processes * gradient_accumulation_steps``: DDP averages gradients over
the processes and ``accelerator.backward`` divides by the accumulation steps; the summed token
loss divided by the world's loss tokens needs neither division.

Importing this module does not import ``accelerate``; the ``Accelerator`` is passed in.
"""

from __future__ import annotations

from typing import Any

import torch.utils.data

from evenflow.engine._config import LoaderConfig
from evenflow.engine.errors import ConfigError
from evenflow.engine.integrations._common import LoaderView, make_loader, state_group

__all__ = ["AcceleratorLoader", "prepare_loader"]


class AcceleratorLoader(LoaderView):
    """The loader view :func:`prepare_loader` returns (one optimizer step per loader step)."""

    def __init__(self, loader: Any, *, accelerator: Any, **kwargs: Any) -> None:
        super().__init__(loader, **kwargs)
        self._accelerator = accelerator

    @property
    def loss_scale(self) -> float:
        """What to multiply ``out.loss`` by before ``accelerator.backward`` (see the module)."""
        accelerator = self._accelerator
        return float(accelerator.num_processes * accelerator.gradient_accumulation_steps)

    def close(self) -> None:
        """Close the loader (its threads and process groups)."""
        self.loader.close()

    def __enter__(self) -> AcceleratorLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepare_loader(
    accelerator: Any,
    dataset: Any,
    *,
    seq_len: int | None = None,
    bins_per_microbatch: int = 1,
    seed: int = 0,
    loader_config: LoaderConfig | None = None,
    source_kwargs: dict[str, Any] | None = None,
    loader_kwargs: dict[str, Any] | None = None,
) -> AcceleratorLoader:
    """The balanced loader of this process, registered for Accelerate's checkpoints.

    ``dataset``: a map-style dataset of tokenized samples (``input_ids``, optional ``labels``),
    the same on every process, or a ``DatasetSource``. Each microbatch is
    ``bins_per_microbatch`` packed bins of ``seq_len`` tokens in one row; a loader step is
    ``accelerator.gradient_accumulation_steps`` microbatches (``bins_per_rank`` is their
    product; a ``loader_config`` must agree). Call it on every process at the same point.
    """
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise TypeError(
            "prepare_loader takes the dataset, not a DataLoader: the loader shards and batches "
            "it itself, and a DataLoader would be re-sharded by accelerator.prepare. Pass "
            "dataloader.dataset."
        )
    steps = int(accelerator.gradient_accumulation_steps)
    bins = bins_per_microbatch * steps
    if loader_config is None:
        if seq_len is None:
            raise ConfigError("Pass seq_len= (tokens per packed bin) or loader_config=.")
        loader_config = LoaderConfig(seq_len=seq_len, bins_per_rank=bins, log_stats=False)
    if loader_config.bins_per_rank != bins:
        raise ConfigError(
            f"loader_config.bins_per_rank={loader_config.bins_per_rank}, but "
            f"bins_per_microbatch={bins_per_microbatch} x the Accelerator's "
            f"gradient_accumulation_steps={steps} = {bins}; make them equal."
        )
    loader = make_loader(
        dataset,
        loader_config,
        rank=int(accelerator.process_index),
        num_ranks=int(accelerator.num_processes),
        seed=seed,
        source_kwargs=source_kwargs,
        loader_kwargs=loader_kwargs,
    )
    try:
        view = AcceleratorLoader(
            loader,
            accelerator=accelerator,
            bins_per_microbatch=bins_per_microbatch,
            extra={"use_cache": False},
            with_num_items=True,
            # save_state writes the main process's objects only: every rank's state goes in.
            gather_group=state_group(loader_config.timeout),
        )
    except BaseException:
        loader.close()
        raise
    accelerator.register_for_checkpointing(view)
    return view
