"""An Accelerate training loop (no Trainer) on balanced, packed steps.

What it shows (docs/howto/accelerate.md walks through it):

* ``prepare_loader``: the loader of this process, built from the ``Accelerator``'s own state
  (process index, number of processes, ``gradient_accumulation_steps``) and registered for
  Accelerate's checkpoints; ``accelerator.prepare`` leaves it alone (it is not a
  ``DataLoader``, so it is never re-sharded);
* ``set_epoch`` at the top of every epoch;
* the loss recipe: each batch carries ``num_items_in_batch`` (the world's loss tokens of its
  step) and ``use_cache=False``; ``out.loss * train.loss_scale`` undoes DDP's and
  ``accelerator.backward``'s divisions, so the update is the world's mean token loss;
* ``accelerator.save_state`` / ``load_state`` carry the loader: ``--resume`` continues exactly
  where the checkpoint was taken.

The model is a tiny random-weight Llama built from a config and the data an in-memory
``datasets.Dataset``; nothing is downloaded. Run it with::

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py

Options: ``--epochs N`` (default 2), ``--save-at N`` (save the state after N optimizer steps,
default 2, in the first epoch), ``--out DIR`` (default ./evenflow-accelerate), ``--resume``,
``--samples N``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_training_loop import tiny_llama, tokenized_dataset

from evenflow.engine.integrations.accelerate import prepare_loader

SEQ_LEN = 128


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", default="evenflow-accelerate")
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args(argv)
    dataset = tokenized_dataset(options.samples, SEQ_LEN)  # input_ids, labels

    # -- evenflow (docs/howto/accelerate.md shows this block as it is) --
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
    model = tiny_llama(SEQ_LEN)  # use_cache=False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    train = prepare_loader(accelerator, dataset, seq_len=SEQ_LEN)  # registered for save_state
    if options.resume:
        accelerator.load_state(options.out)  # the loader's position too
    with train:
        for epoch in range(train.start_epoch, options.epochs):
            train.set_epoch(epoch)
            step_loss = torch.zeros(())
            for batch in train:  # one packed row; use_cache=False, num_items_in_batch inside
                with accelerator.accumulate(model):
                    out = model(**batch)  # summed token loss / the world's loss tokens
                    accelerator.backward(out.loss * train.loss_scale)
                    optimizer.step()
                    optimizer.zero_grad()
                step_loss += out.loss.detach()
                if accelerator.sync_gradients:  # the step's last microbatch
                    report(accelerator, train.loader, step_loss)
                    step_loss = torch.zeros(())
                    if (epoch, train.loader.step) == (0, options.save_at):
                        accelerator.save_state(options.out)
    # --
    return 0


def report(accelerator: Accelerator, loader: Any, step_loss: torch.Tensor) -> None:
    """Print the world's mean token loss of the step and its balance (rank 0)."""
    if dist.is_initialized():
        dist.all_reduce(step_loss)  # each rank's share of the world's mean
    stats = loader.last_stats
    if accelerator.is_main_process and stats is not None:
        print(
            f"epoch {loader.epoch} step {loader.step}: loss {float(step_loss):.4f} over "
            f"{loader.last_loss_tokens.world} loss tokens, max cost {stats.max_cost_before:.3g}"
            f" -> {stats.max_cost_after:.3g}, moved {stats.num_moved}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
