"""Tokenize in parallel, pack into balanced steps: ``IterableSource`` over worker processes.

What it shows:

* the read stage off one Python thread: a ``torchdata`` ``StatefulDataLoader`` whose
  ``--workers`` processes tokenize raw text (``batch_size=32, collate_fn=list``: each worker
  returns lists of tokenized samples), wrapped in ``IterableSource(..., batched=True)``, which
  packs the samples into steps of ``bins_per_rank`` bins as they arrive;
* the same with a thread pool instead (``--mode threads``): a factory that maps the tokenizer
  over chunks of text with ``ThreadPoolExecutor.map`` (real tokenizers release the GIL);
* ``BalancedLoader(source, config=..., metadata_fn=source.metadata_fn)``: the token counts come
  from the lengths the source already measured;
* an exact resume: the state saved after ``--stop-after`` steps, restored into fresh loaders
  (fresh workers), yields exactly the rest of the run — the source's state holds the data
  loader's own state and the few samples the packer had buffered.

Each rank is a process (two, on Gloo over loopback, started by ``evenflow.transports.launch``)
and tokenizes its own shard of the texts (``texts[rank::num_ranks]``). Run it with::

    python examples/parallel_tokenize.py --workers 2

Options: ``--workers N`` (default 2), ``--texts N`` (default 2000), ``--stop-after N``
(default 5), ``--mode workers|threads|both`` (default both).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from evenflow.engine import BalancedLoader, IterableSource, LoaderConfig
from evenflow.transports import GlooTransport
from evenflow.transports.launch import run_ranks

CONFIG = LoaderConfig(seq_len=512, bins_per_rank=2, log_stats=False)
NUM_RANKS = 2
WORDS = ["data", "rank", "step", "token", "bin", "plan", "pack", "move", "batch", "epoch"]


def make_texts(count: int) -> list[str]:
    """Deterministic raw documents of very different lengths (a few long ones)."""
    rng = np.random.default_rng(0)
    sizes = np.minimum(rng.lognormal(3.5, 1.0, size=count).astype(int) + 1, 400)
    return [" ".join(rng.choice(WORDS, size=int(n))) for n in sizes]


def tokenize(text: str) -> dict[str, Any]:
    """A stand-in tokenizer: a stable hash per word (real ones are CPU-heavy like this)."""
    ids = [
        int.from_bytes(hashlib.blake2b(w.encode(), digest_size=2).digest()) for w in text.split()
    ]
    return {"input_ids": np.asarray(ids, dtype=np.int64)}


class Tokenized(torch.utils.data.Dataset[dict[str, Any]]):
    """Item ``i`` is text ``i`` tokenized: the work the loader's workers do in parallel."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return tokenize(self.texts[i])


def worker_source(texts: list[str], workers: int) -> IterableSource:
    # "fork" starts workers in milliseconds; ranks started by spawn would otherwise spawn their
    # workers too (a fresh interpreter and torch import each). Use "spawn" where fork is unsafe.
    loader = StatefulDataLoader(
        Tokenized(texts),
        batch_size=32,
        num_workers=workers,
        collate_fn=list,
        multiprocessing_context="fork" if workers else None,
    )
    return IterableSource(loader, seq_len=CONFIG.seq_len, bins_per_rank=2, batched=True)


def thread_source(texts: list[str], workers: int) -> IterableSource:
    def samples() -> Iterator[list[dict[str, Any]]]:
        chunks = [texts[i : i + 32] for i in range(0, len(texts), 32)]
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            yield from pool.map(lambda chunk: [tokenize(t) for t in chunk], chunks)

    return IterableSource(samples, seq_len=CONFIG.seq_len, bins_per_rank=2, batched=True)


def tokens_of(batch: list[dict[str, Any]]) -> list[list[int]]:
    return [b["input_ids"].tolist() for b in batch]


def rank_main(rank: int, num_ranks: int, options: dict[str, Any]) -> dict[str, Any]:
    """One rank (one process): every mode in turn."""
    return {mode: run_mode(rank, num_ranks, mode, options) for mode in options["modes"]}


def run_mode(rank: int, num_ranks: int, mode: str, options: dict[str, Any]) -> dict[str, Any]:
    """A run that checkpoints after ``stop_after`` steps, then a restore of that checkpoint."""
    workers, stop_after = options["workers"], options["stop_after"]
    make: Callable[[list[str], int], IterableSource] = (
        worker_source if mode == "workers" else thread_source
    )
    texts = make_texts(options["texts"])[rank::num_ranks]  # this rank's shard

    def new_loader() -> BalancedLoader:
        source = make(texts, workers)
        return BalancedLoader(
            source,
            config=CONFIG,
            transport=GlooTransport(timeout=30.0),
            metadata_fn=source.metadata_fn,
        )

    with new_loader() as loader:
        reference, moved = [], 0
        for batch in loader:
            reference.append(tokens_of(batch))
            moved += loader.last_stats.num_moved if loader.last_stats else 0
            if loader.step == stop_after:
                state = loader.state_dict()  # what a checkpoint at this step would store
    with new_loader() as loader:  # as after a restart: fresh loader, source and workers
        loader.load_state_dict(state)
        tail = [tokens_of(batch) for batch in loader]
    return {
        "steps": len(reference),
        "tokens": sum(len(packed) for step in reference for packed in step),
        "moved": moved,
        "equal": tail == reference[stop_after:],
    }


def report(mode: str, results: list[dict[str, Any]], stop_after: int) -> bool:
    for rank, result in enumerate(results):
        print(
            f"{mode}: rank {rank} trained {result['steps']} steps ({result['tokens']} tokens), "
            f"{result['moved']} samples moved to balance"
        )
    equal = all(result["equal"] for result in results)
    print(
        f"{mode}: restored the checkpoint of step {stop_after}; the rest equals the run on "
        f"every rank: {equal}"
    )
    return equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--stop-after", type=int, default=5)
    parser.add_argument("--mode", choices=["workers", "threads", "both"], default="both")
    args = parser.parse_args()
    modes = ["workers", "threads"] if args.mode == "both" else [args.mode]
    options = {
        "modes": modes,
        "texts": args.texts,
        "workers": args.workers,
        "stop_after": args.stop_after,
    }
    results = run_ranks(rank_main, NUM_RANKS, args=(options,), deadline=300.0)
    equal = [report(mode, [r[mode] for r in results], args.stop_after) for mode in modes]
    if not all(equal):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
