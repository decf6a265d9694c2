"""Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``) on balanced, packed steps.

``EvenflowTrainer`` is a ``transformers.Trainer``; :func:`with_evenflow` makes the same of any
``Trainer`` subclass (``with_evenflow(SFTTrainer)``). What they change, and why:

* **The training data.** ``get_train_dataloader`` builds a loader over ``train_dataset`` from the
  trainer's own arguments: data-parallel rank and world size (``process_index``,
  ``world_size``), the seed (``data_seed`` or ``seed``), and ``bins_per_rank =
  per_device_train_batch_size * gradient_accumulation_steps``: each microbatch is
  ``per_device_train_batch_size`` packed bins of ``seq_len`` tokens merged into one row, each
  optimizer step one balanced step. The model gets the packed Hugging Face layout
  (``position_ids``, ``cu_seq_lens_q/k``, labels -100 at every sample's start) with
  ``use_cache=False``. The loader is not a ``DataLoader``, so Accelerate never re-shards it.
* **The loss divisor.** ``num_items_in_batch`` is ``loader.last_loss_tokens.world``: the loss
  targets of the whole world in this step. The Trainer divides each microbatch's summed token
  loss by it and multiplies by the world size that DDP divides by, so the update is the mean
  token loss over the world, the same with balancing on and off.
* **Epochs.** The Trainer calls ``set_epoch`` at the top of every epoch; each epoch is a new
  pass of the loader (its own shuffle).
* **Checkpoints.** Every rank writes its loader's state into the Trainer's checkpoint folder
  (``evenflow-loader-rank<k>.pt``); ``train(resume_from_checkpoint=...)`` restores it after
  the Trainer's ``set_epoch``: the next step is the one the interrupted run would have
  trained, with no batches skipped or replayed. ``args.ignore_data_skip`` is set to True: the
  loader resumes itself, and the Trainer's own skipping would read the steps again.
* **Logs.** Each ``log`` the Trainer writes (``logging_steps``) carries the balance of the steps
  since the last one (``evenflow/...`` keys), so every ``on_log`` callback and
  ``state.log_history`` see them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.trainer_utils import get_last_checkpoint

from evenflow.engine._config import LoaderConfig
from evenflow.engine.errors import ConfigError, ResumeError
from evenflow.engine.integrations._common import LoaderView, make_loader

__all__ = ["EvenflowTrainer", "EvenflowTrainerMixin", "with_evenflow"]

#: transformers' own lookup of the newest ``checkpoint-<step>`` folder (typed here).
_last_checkpoint: Callable[[str], str | None] = get_last_checkpoint

#: The name of each rank's loader state inside a Trainer checkpoint folder.
STATE_FILE = "evenflow-loader-rank{rank}.pt"


class _BalanceLog:
    """The balance of the steps since the last log line, as Trainer log keys."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.moved = 0
        self.before = 0.0
        self.after = 0.0
        self.gap = 0.0

    def add(self, stats: Any) -> None:
        self.steps += 1
        self.moved += int(stats.num_moved)
        self.before += float(stats.max_cost_before)
        self.after += float(stats.max_cost_after)
        self.gap += float(stats.gap)

    def logs(self) -> dict[str, float]:
        if not self.steps:
            return {}
        n = self.steps
        out = {
            "evenflow/max_cost_before": self.before / n,
            "evenflow/max_cost_after": self.after / n,
            "evenflow/predicted_speedup": self.before / self.after if self.after else 1.0,
            "evenflow/gap_to_bound": self.gap / n,
            "evenflow/moved_samples": float(self.moved),
            "evenflow/steps": float(n),
        }
        self.reset()
        return out


class _LoaderCallback(transformers.TrainerCallback):
    """Writes each rank's loader state into the checkpoint; closes the loader at the end."""

    def __init__(self, trainer: EvenflowTrainerMixin) -> None:
        self._trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        view = self._trainer.evenflow_view
        if view is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(rank=args.process_index))
        torch.save(view.state_dict(), path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer.close_evenflow()


class EvenflowTrainerMixin:
    """Put it before a ``Trainer`` class in the bases (:func:`with_evenflow` does).

    Keyword arguments, beside the Trainer's own:

    ``seq_len``: tokens per packed bin (or give ``loader_config``, whose ``bins_per_rank`` must
    then be ``per_device_train_batch_size * gradient_accumulation_steps``).
    ``source_kwargs``: more ``DatasetSource`` arguments (``lengths``, ``packer``, ...).
    ``loader_kwargs``: more loader arguments (``cost_model``, ``algorithm``, ...; the default
    cost model is the FLOPs model of the model's config).
    """

    def __init__(
        self,
        *args: Any,
        seq_len: int | None = None,
        loader_config: LoaderConfig | None = None,
        source_kwargs: dict[str, Any] | None = None,
        loader_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        trainer: Any = self
        targs = trainer.args
        bins = targs.per_device_train_batch_size * targs.gradient_accumulation_steps
        if loader_config is None:
            if seq_len is None:
                raise ConfigError(
                    "Pass seq_len= (tokens per packed bin) or loader_config= to "
                    f"{type(self).__name__}: the Trainer's arguments do not say it."
                )
            loader_config = LoaderConfig(seq_len=seq_len, bins_per_rank=bins, log_stats=False)
        elif seq_len is not None and seq_len != loader_config.seq_len:
            raise ConfigError(
                f"seq_len={seq_len} differs from loader_config.seq_len={loader_config.seq_len}; "
                "pass one of them."
            )
        if loader_config.bins_per_rank != bins:
            raise ConfigError(
                f"loader_config.bins_per_rank={loader_config.bins_per_rank}, but the Trainer "
                f"trains per_device_train_batch_size={targs.per_device_train_batch_size} bins "
                f"per microbatch x gradient_accumulation_steps="
                f"{targs.gradient_accumulation_steps} per step = {bins}; make them equal."
            )
        if not targs.average_tokens_across_devices:
            raise ConfigError(
                "average_tokens_across_devices=False: the Trainer would then not scale the "
                "loss by the world size that DDP divides by, and num_items_in_batch (the "
                "world's loss tokens) would shrink every update. Leave it True (the default)."
            )
        if not targs.ignore_data_skip:
            # The loader restores its own position; the Trainer's batch skipping would read
            # the steps again (and fails on an object that is not a DataLoader).
            targs.ignore_data_skip = True
        self.evenflow_config = loader_config
        self._evenflow_source_kwargs = dict(source_kwargs or {})
        self._evenflow_loader_kwargs = dict(loader_kwargs or {})
        self._evenflow_pending: dict[str, Any] | None = None
        self._evenflow_balance = _BalanceLog()
        self.evenflow_view: LoaderView | None = None
        trainer.add_callback(_LoaderCallback(self))

    @property
    def evenflow_loader(self) -> Any:
        """The loader of the current ``train()`` call (None before it)."""
        return None if self.evenflow_view is None else self.evenflow_view.loader

    def get_train_dataloader(self) -> Any:
        trainer: Any = self
        if trainer.train_dataset is None:
            raise ValueError("The Trainer needs a train_dataset to train on.")
        self.close_evenflow()
        targs = trainer.args
        config = dataclasses.replace(self.evenflow_config, bins_per_rank=self._bins_per_step(targs))
        kwargs = dict(self._evenflow_loader_kwargs)
        kwargs.setdefault("cost_model", _cost_model(trainer.model))
        user_callback = kwargs.pop("stats_callback", None)

        def on_stats(stats: Any) -> None:
            self._evenflow_balance.add(stats)
            if user_callback is not None:
                user_callback(stats)

        kwargs["stats_callback"] = on_stats
        seed = targs.data_seed if targs.data_seed is not None else targs.seed
        loader = make_loader(
            trainer.train_dataset,
            config,
            rank=targs.process_index,
            num_ranks=targs.world_size,
            seed=seed,
            source_kwargs=self._evenflow_source_kwargs,
            loader_kwargs=kwargs,
        )
        view = LoaderView(
            loader,
            bins_per_microbatch=targs.per_device_train_batch_size,
            extra={"use_cache": False},
        )
        pending, self._evenflow_pending = self._evenflow_pending, None
        if pending is not None:
            view.load_state_dict(pending)
        self.evenflow_view = view
        return view

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: Any
    ) -> tuple[list[Any], Any]:
        """The step's microbatches, and the world's loss tokens of the step as
        ``num_items_in_batch`` (no collective: the loader counted them)."""
        batch_samples: list[Any] = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        loader = self.evenflow_loader
        if not batch_samples or loader is None:
            return batch_samples, None
        tokens = loader.last_loss_tokens
        if tokens is None:
            raise ConfigError(
                "The loader does not know this step's loss tokens (a custom pack_fn whose "
                "metadata_fn sets no loss_tokens); num_items_in_batch needs them. Use the "
                "default pack_fn or set SampleMetadata.loss_tokens."
            )
        return batch_samples, torch.tensor(tokens.world, device=device)

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        trainer: Any = self
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _last_checkpoint(trainer.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({trainer.args.output_dir})"
                )
        self._evenflow_pending = None
        if isinstance(resume_from_checkpoint, str):
            path = os.path.join(
                resume_from_checkpoint, STATE_FILE.format(rank=trainer.args.process_index)
            )
            if not os.path.isfile(path):
                raise ResumeError(
                    f"The checkpoint {resume_from_checkpoint!r} has no loader state for rank "
                    f"{trainer.args.process_index} ({os.path.basename(path)}): it was not "
                    "written by an evenflow Trainer, or by fewer ranks. Resume from a "
                    "checkpoint of this run."
                )
            self._evenflow_pending = torch.load(path, weights_only=True)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self.close_evenflow()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # a training log line: add the balance since the last one
            logs = {**logs, **self._evenflow_balance.logs()}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def close_evenflow(self) -> None:
        """Close the loader of the last ``train()`` (its threads and process groups)."""
        view, self.evenflow_view = self.evenflow_view, None
        if view is not None:
            view.loader.close()

    @staticmethod
    def _bins_per_step(targs: Any) -> int:
        return int(targs.per_device_train_batch_size * targs.gradient_accumulation_steps)


def _cost_model(model: Any) -> Any:
    """The FLOPs cost model of a Hugging Face model's config, else the default."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def with_evenflow(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) with
    :class:`EvenflowTrainerMixin` in front."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(
            f"with_evenflow needs a transformers.Trainer subclass, but got {trainer_class!r}."
        )
    if issubclass(trainer_class, EvenflowTrainerMixin):
        return trainer_class
    return type(f"Evenflow{trainer_class.__name__}", (EvenflowTrainerMixin, trainer_class), {})


class EvenflowTrainer(EvenflowTrainerMixin, transformers.Trainer):
    """A ``transformers.Trainer`` that trains on balanced, packed steps (see the module)."""
