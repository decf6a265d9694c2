"""A PyTorch Lightning ``Trainer`` on balanced, packed steps.

What it shows (docs/howto/lightning.md walks through it):

* ``EvenflowDataModule``: the training data of a ``LightningDataModule``, built in
  ``train_dataloader()`` from the Lightning ``Trainer``'s own state (rank, world size,
  ``accumulate_grad_batches``); Lightning sets each epoch through it;
* the loss recipe in ``training_step``: each batch carries ``num_items_in_batch`` (the world's
  loss tokens of its step) and ``use_cache=False``; ``out.loss * dm.loss_scale`` undoes DDP's
  and Lightning's divisions, so the update is the world's mean token loss;
* the loader's state in Lightning's checkpoint: ``--resume`` continues from the checkpoint a
  ``ModelCheckpoint`` wrote after ``--save-at`` steps, exactly (it writes one every
  ``--save-at`` steps).

The model is a tiny random-weight Llama built from a config and the data an in-memory
``datasets.Dataset``; nothing is downloaded. Run it with::

    torchrun --standalone --nproc-per-node 2 examples/lightning_module.py

Options: ``--epochs N`` (default 2), ``--save-at N`` (default 2), ``--out DIR`` (default
./evenflow-lightning), ``--resume``, ``--samples N``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import lightning
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_training_loop import tiny_llama, tokenized_dataset

from evenflow.engine.integrations.lightning import EvenflowDataModule

SEQ_LEN = 128


class CausalLM(lightning.LightningModule):
    """A Hugging Face causal LM trained on the data module's batches."""

    def __init__(self, dm: EvenflowDataModule) -> None:
        super().__init__()
        self.model = tiny_llama(SEQ_LEN)  # use_cache=False
        self.dm = dm
        self.step_loss = torch.zeros(())

    # -- evenflow (docs/howto/lightning.md shows this block as it is) --
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)  # batch: use_cache=False, num_items_in_batch inside
        self.step_loss += out.loss.detach()  # summed token loss / the world's loss tokens
        return out.loss * self.dm.loss_scale  # undoes DDP's and accumulation's divisions

    # --

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches:
            return
        loss, self.step_loss = self.step_loss, torch.zeros(())
        if dist.is_initialized():
            dist.all_reduce(loss)
        view = self.dm.view
        stats = None if view is None else view.loader.last_stats
        if self.trainer.is_global_zero and stats is not None:
            print(
                f"step {self.trainer.global_step}: loss {float(loss):.4f}, max cost "
                f"{stats.max_cost_before:.3g} -> {stats.max_cost_after:.3g}, moved "
                f"{stats.num_moved}",
                flush=True,
            )

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", default="evenflow-lightning")
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args(argv)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=options.out,
        filename="{step}",
        every_n_train_steps=options.save_at,
        save_top_k=-1,
        enable_version_counter=False,
    )
    # ModelCheckpoint writes step=<N>.ckpt every --save-at steps; resume from the first.
    resume = os.path.join(options.out, f"step={options.save_at}.ckpt") if options.resume else None

    # -- evenflow (docs/howto/lightning.md shows this block as it is) --
    dm = EvenflowDataModule(tokenized_dataset(options.samples, SEQ_LEN), seq_len=SEQ_LEN)
    trainer = lightning.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=options.epochs,
        accumulate_grad_batches=2,  # microbatches per balanced step
        use_distributed_sampler=False,  # the loader shards and balances itself
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(CausalLM(dm), datamodule=dm, ckpt_path=resume)  # restores the loader too
    # --
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
