"""torchtitan's dataloader protocol: ``TitanLoader`` in a torchtitan-style training loop.

What it shows (docs/howto/torchtitan.md walks through it):

* ``TitanLoader`` over ``build_loader``: a ``Stateful`` whose iterator yields torchtitan's
  ``(input_dict, labels)`` microbatches: ``{"input", "positions"}`` and shifted labels;
* the loop torchtitan's trainer runs: pull ``gradient_accumulation_steps`` microbatches, count
  the valid labels and sum them over the data-parallel ranks (that sum is the loader's
  ``last_loss_tokens.world``), divide each microbatch's summed token loss by it;
* the loader saved with ``torch.distributed.checkpoint`` under per-rank keys
  (``dp_rank_<k>``), as torchtitan's checkpointer does, and ``--resume`` continuing exactly.

torchtitan itself is not needed (nor installed by the test extra); with it, this is the
object to return from a ``build_dataloader_fn``. The model is a tiny random-weight Hugging Face
Llama; nothing is downloaded. Run it with::

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_loader.py

Options: ``--steps N`` (default 8; epochs follow each other), ``--save-at N`` (default 3),
``--out DIR`` (default ./evenflow-titan), ``--resume``, ``--samples N``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_training_loop import tiny_llama, tokenized_dataset

from evenflow.engine import DatasetSource, LoaderConfig, build_loader
from evenflow.engine.integrations.torchtitan import TitanLoader

SEQ_LEN = 128
ACCUMULATION = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", default="evenflow-titan")
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(SEQ_LEN)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    # -- evenflow (docs/howto/torchtitan.md shows this block as it is) --
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=ACCUMULATION, log_stats=False)
    source = DatasetSource(
        tokenized_dataset(options.samples, SEQ_LEN),
        seq_len=SEQ_LEN,
        bins_per_rank=ACCUMULATION,  # one packed bin per microbatch
        rank=rank,  # data-parallel rank and size
        num_ranks=world,
        shared=True,
    )
    dataloader = TitanLoader(build_loader(source, config), dp_rank=rank, dp_world_size=world)
    # --

    step = 0
    if options.resume:
        model_state, optim_state = get_state_dict(ddp, optimizer)
        state = {"dataloader": dataloader, "model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=options.out)  # the loader's: its dp_rank_<k> key
        set_state_dict(
            ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        with open(os.path.join(options.out, "step.json")) as f:
            step = json.load(f)["step"]
    batches = iter(dataloader)
    while step < options.steps:
        micro = [next(batches) for _ in range(ACCUMULATION)]
        valid = torch.tensor(sum(int((labels != -100).sum()) for _, labels in micro))
        dist.all_reduce(valid)  # what torchtitan computes: the world's loss tokens
        assert int(valid) == dataloader.loader.last_loss_tokens.world
        step_loss = torch.zeros(())
        for i, (inputs, labels) in enumerate(micro):
            sync = i == len(micro) - 1
            with torch.enable_grad() if sync else ddp.no_sync():
                logits = ddp(
                    input_ids=inputs["input"], position_ids=inputs["positions"], use_cache=False
                ).logits
                loss = (
                    F.cross_entropy(
                        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
                    )
                    / valid
                )
                (loss * world).backward()  # DDP averages over the ranks
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        dist.all_reduce(step_loss)
        stats = dataloader.loader.last_stats
        if rank == 0 and stats is not None:
            print(
                f"step {step}: loss {float(step_loss):.4f} over {int(valid)} loss tokens, "
                f"max cost {stats.max_cost_before:.3g} -> {stats.max_cost_after:.3g}, moved "
                f"{stats.num_moved}",
                flush=True,
            )
        if step == options.save_at and not options.resume:
            model_state, optim_state = get_state_dict(ddp, optimizer)
            state = {"dataloader": dataloader, "model": model_state, "optim": optim_state}
            dcp.save(state, checkpoint_id=options.out)
            if rank == 0:
                with open(os.path.join(options.out, "step.json"), "w") as f:
                    json.dump({"step": step}, f)
    dataloader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
