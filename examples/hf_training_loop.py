"""The README's training loop, runnable: a Hugging Face causal LM trained with DDP under torchrun.

What it shows:

* ranks taken from torchrun's environment, NCCL and the device data plane on GPUs, Gloo and
  host batches on CPU;
* a tokenized ``datasets.Dataset`` (``input_ids`` and prompt-masked ``labels``) read through
  ``DatasetSource``: shuffled per epoch, packed into bins, resumable;
* ``default_pack_fn``'s packed bins splatted straight into a Hugging Face model
  (``input_ids``, ``labels``, ``position_ids`` ``[1, T]``, ``cu_seq_lens_q/k``,
  ``max_length_q/k``) with ``use_cache=False``: with a cache, the samples of a bin would
  attend to each other;
* the loss recipe that makes balancing invisible to the optimiser: each microbatch's summed
  token loss divided by the world's loss tokens of the step (``loader.last_loss_tokens``),
  times the world size that DDP divides gradients by. The update is then the gradient of the
  mean token loss over the whole world, whatever the plan moved (tests/test_train_hf.py checks
  it against balancing off, for DDP and FSDP2);
* the two launch points (``prefetch_plan()`` after the first forward, ``prefetch()`` after the
  backward passes).

The model is a tiny random-weight Llama built from a config and the data an in-memory
``datasets.Dataset`` read by ``DatasetSource(shared=True)`` (every rank can read it, so only
indices travel); nothing is downloaded. Run it with::

    torchrun --standalone --nproc-per-node 2 examples/hf_training_loop.py

Options: ``--steps N`` (default 6), ``--seq-len N`` (default 128). The test suite runs it with
``--steps 3``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import datasets
import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

from evenflow.engine import DatasetSource, LoaderConfig, build_loader

VOCAB = 256


def tiny_llama(seq_len: int) -> Any:
    """A two-layer Llama with random weights; the same on every rank (seeded)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def tokenized_dataset(num_samples: int, seq_len: int) -> datasets.Dataset:
    """A stand-in for a tokenized SFT set, identical on every rank (seeded): lengths from
    short to ``seq_len / 2``, and every other sample masks a prompt out of the loss."""
    gen = torch.Generator().manual_seed(7)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for i in range(num_samples):
        # Mostly short samples and a few long ones: what makes packed steps uneven.
        top = seq_len // 2 if i % 5 == 0 else seq_len // 8
        n = int(torch.randint(4, top, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        prompt = n // 3 if i % 2 else 0
        rows["input_ids"].append(ids)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    return datasets.Dataset.from_dict(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)

    # -- the loop (README.md shows this block as it is) --
    rank = int(os.environ["RANK"])  # set by torchrun
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    model = DistributedDataParallel(tiny_llama(args.seq_len).to(device))  # use_cache=False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = LoaderConfig(
        seq_len=args.seq_len, bins_per_rank=2, max_steps=args.steps, log_stats=False
    )
    source = DatasetSource(  # shuffled per epoch, packed into 2 bins per step, resumable
        tokenized_dataset(400, args.seq_len),  # a datasets.Dataset: input_ids, labels
        shared=True,  # every rank can read the dataset: only indices travel
    )  # seq_len, bins per step and this rank's data-parallel position: from the loader
    loader = build_loader(
        source,
        config,
        cost_model=model.module.config.to_dict(),  # FLOPs model from the HF config
        transport="device" if cuda else "gloo",  # NCCL on a data stream, or Gloo on CPU
        device=device if cuda else None,  # None: batches stay on the host
    )
    with loader:
        for batch in loader:  # one packed bin per microbatch, on the device
            tokens = loader.last_loss_tokens  # loss targets: this rank, its group, the world
            step_loss = torch.zeros((), device=device)
            for i, packed in enumerate(batch):
                last = i == len(batch) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    # input_ids, labels, position_ids [1, T]; cu_seq_lens_q/k, max_length_q/k.
                    # use_cache=False: with a cache, packed samples attend to each other.
                    out = model(**packed, use_cache=False, num_items_in_batch=tokens.world)
                    # out.loss: summed token loss / world's tokens; DDP averages over ranks.
                    (out.loss * world_size).backward()
                step_loss += out.loss.detach()
                if i == 0:
                    loader.prefetch_plan()  # launch points while compute is pending
            loader.prefetch()
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(step_loss)  # the mean token loss over the whole world
            stats = loader.last_stats
            if rank == 0 and stats is not None:
                print(
                    f"step {stats.step}: loss {step_loss.item():.4f} over {tokens.world} loss "
                    f"tokens (this rank {tokens.rank}), max cost {stats.max_cost_before:.3g} -> "
                    f"{stats.max_cost_after:.3g}, moved {stats.num_moved}",
                    flush=True,
                )
    dist.destroy_process_group()
    # -- end of the loop --
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
