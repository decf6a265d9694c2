"""PyTorch Lightning: a ``LightningDataModule`` whose training data is a balanced loader.

:class:`EvenflowDataModule` builds, in ``train_dataloader()``, the loader of this process from
the Lightning ``Trainer``'s own state (``global_rank``, ``world_size``,
``accumulate_grad_batches``) and returns a :class:`~evenflow.engine.integrations.LoaderView`:

* Lightning sets the epoch of a loader through its ``sampler``'s ``set_epoch``; the view's
  ``sampler`` forwards it, so every epoch is a new pass of the loader (its own shuffle).
* The view is ``Stateful`` (``state_dict`` / ``load_state_dict``): Lightning stores its state
  in every checkpoint (``loops.fit_loop.state_dict.combined_loader``) and restores it on
  ``trainer.fit(..., ckpt_path=...)``; the next step is the one the interrupted run would have
  trained. The state is gathered from every rank (Lightning writes rank 0's checkpoint), so a
  source with per-rank positions restores too.
* It is not a ``DataLoader``, so Lightning never swaps in a ``DistributedSampler``; pass
  ``use_distributed_sampler=False`` anyway, which says so.

The loss recipe in ``training_step`` (the world's mean token loss, the same with balancing on
and off)::

    out = self.model(**batch)  # the batch carries use_cache=False and num_items_in_batch
    return out.loss * dm.loss_scale

``loss_scale`` is ``world_size * accumulate_grad_batches``: DDP averages gradients over the
ranks and Lightning divides the loss by the accumulation steps.
"""

from __future__ import annotations

from typing import Any

import lightning

from evenflow.engine._config import LoaderConfig
from evenflow.engine.errors import ConfigError
from evenflow.engine.integrations._common import LoaderView, make_loader, state_group

__all__ = ["EvenflowDataModule"]


class _EpochSetter:
    """What Lightning finds as the loader's ``sampler``: it calls ``set_epoch`` on it."""

    def __init__(self, view: LoaderView) -> None:
        self._view = view

    def set_epoch(self, epoch: int) -> None:
        self._view.set_epoch(epoch)


class _LightningView(LoaderView):
    @property
    def sampler(self) -> _EpochSetter:
        return _EpochSetter(self)


class EvenflowDataModule(lightning.LightningDataModule):
    """Balanced, packed training steps over ``dataset`` for a Lightning ``Trainer``.

    ``dataset``: a map-style dataset of tokenized samples (``input_ids``, optional
    ``labels``), the same on every rank, or a ``DatasetSource``. Each microbatch is
    ``bins_per_microbatch`` packed bins of ``seq_len`` tokens in one row; a loader step is
    ``accumulate_grad_batches`` microbatches (``bins_per_rank`` is their product; a
    ``loader_config`` must agree).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        seq_len: int | None = None,
        bins_per_microbatch: int = 1,
        seed: int = 0,
        loader_config: LoaderConfig | None = None,
        source_kwargs: dict[str, Any] | None = None,
        loader_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if loader_config is None and seq_len is None:
            raise ConfigError("Pass seq_len= (tokens per packed bin) or loader_config=.")
        self._dataset = dataset
        self._seq_len = seq_len
        self._per = bins_per_microbatch
        self._seed = seed
        self._config = loader_config
        self._source_kwargs = source_kwargs
        self._loader_kwargs = loader_kwargs
        self.view: LoaderView | None = None

    def train_dataloader(self) -> LoaderView:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("train_dataloader() needs the DataModule attached to a Trainer.")
        steps = int(trainer.accumulate_grad_batches)
        bins = self._per * steps
        config = self._config
        if config is None:
            assert self._seq_len is not None
            config = LoaderConfig(seq_len=self._seq_len, bins_per_rank=bins, log_stats=False)
        if config.bins_per_rank != bins:
            raise ConfigError(
                f"loader_config.bins_per_rank={config.bins_per_rank}, but "
                f"bins_per_microbatch={self._per} x the Trainer's accumulate_grad_batches="
                f"{steps} = {bins}; make them equal."
            )
        self.teardown_loader()
        loader = make_loader(
            self._dataset,
            config,
            rank=int(trainer.global_rank),
            num_ranks=int(trainer.world_size),
            seed=self._seed,
            source_kwargs=self._source_kwargs,
            loader_kwargs=self._loader_kwargs,
        )
        try:
            self.view = _LightningView(
                loader,
                bins_per_microbatch=self._per,
                extra={"use_cache": False},
                with_num_items=True,
                gather_group=state_group(config.timeout),
            )
        except BaseException:
            loader.close()
            raise
        return self.view

    @property
    def loss_scale(self) -> float:
        """What to multiply ``out.loss`` by in ``training_step`` (see the module)."""
        trainer = self.trainer
        assert trainer is not None
        return float(trainer.world_size * trainer.accumulate_grad_batches)

    def teardown(self, stage: str) -> None:
        if stage == "fit":
            self.teardown_loader()

    def teardown_loader(self) -> None:
        """Close the loader (its threads and process groups)."""
        view, self.view = self.view, None
        if view is not None:
            view.loader.close()
