"""Elastic resume: train on 4 ranks, checkpoint with torch.distributed.checkpoint, resume on 2.

What it shows:

* ``build_loader`` over a ``DatasetSource`` on a 4-process Gloo world; after a few steps every
  rank calls ``dcp.save({"loader": loader}, checkpoint_id=...)`` (the loader is a DCP
  ``Stateful``: nothing else to write);
* a fresh 2-process world builds the same loader for 2 ranks and calls ``dcp.load`` the same
  way: the source's position is global (the consumed part of the epoch is a prefix of its
  packed units), so the rest of the epoch is dealt to the 2 ranks;
* the check: over the epoch (the 4-rank steps before the checkpoint plus the 2-rank steps
  after it) every sample is delivered at most once, and the ones never delivered are exactly
  the documented remainder: the packer's leftover plus the last units that do not fill a
  step on every rank (``DatasetSource.report``);
* the next epoch is dealt to the 2 ranks from its start.

The ranks are fresh processes (``evenflow.transports.launch.run_ranks``); under torchrun the
rank functions are what each rank runs. Run it with::

    python examples/elastic_resume.py --out ckpt

Options: ``--out DIR`` (default ``./evenflow-elastic``), ``--samples N`` (default 600),
``--stop-after N`` steps on 4 ranks (default 3).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import numpy as np

from evenflow.engine import DatasetSource, LoaderConfig, build_loader
from evenflow.transports.launch import run_ranks

SEQ_LEN = 256
CONFIG = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, log_stats=False, timeout=30.0)


def make_dataset(num_samples: int) -> list[dict[str, Any]]:
    """Samples with an ``id`` (to follow them) and token ids of random lengths."""
    lengths = np.random.default_rng(0).integers(8, 200, size=num_samples)
    return [{"id": i, "input_ids": [i % 1000] * int(n)} for i, n in enumerate(lengths)]


def sample_ids(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    """The ``pack_fn`` of this example: which samples a bin holds (a real one packs tokens)."""
    return [s["id"] for s in samples]


def make_loader(rank: int, num_ranks: int, num_samples: int) -> Any:
    source = DatasetSource(
        make_dataset(num_samples),
        seq_len=SEQ_LEN,
        bins_per_rank=2,
        rank=rank,
        num_ranks=num_ranks,
        seed=1,
    )
    return build_loader(
        source,
        CONFIG,
        balance_group_size=num_ranks,
        metadata_fn=source.metadata_fn,
        pack_fn=sample_ids,
        collate_fn=list,
        cost_model="quadratic",
    )


def train_then_checkpoint(rank: int, num_ranks: int, out: str, samples: int, stop: int) -> Any:
    """Rank ``rank`` of 4: a few steps, then a DCP checkpoint (then the job "dies")."""
    import torch.distributed.checkpoint as dcp

    trained = []
    with make_loader(rank, num_ranks, samples) as loader:
        for batch in loader:
            trained += [i for bin_ids in batch for i in bin_ids]
            if loader.step == stop:
                dcp.save({"loader": loader}, checkpoint_id=out)
                break
    return trained


def resume(rank: int, num_ranks: int, out: str, samples: int) -> Any:
    """Rank ``rank`` of 2: restore, finish the epoch, then train the next one."""
    import torch.distributed.checkpoint as dcp

    with make_loader(rank, num_ranks, samples) as loader:
        dcp.load({"loader": loader}, checkpoint_id=out)
        first = loader.step
        rest = [i for batch in loader for bin_ids in batch for i in bin_ids]
        loader.set_epoch(1)
        steps = sum(1 for _ in loader)
    return first, rest, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("evenflow-elastic"))
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--stop-after", type=int, default=3)
    args = parser.parse_args(argv)
    out = str(args.out.resolve() / "step-checkpoint")

    before = run_ranks(
        train_then_checkpoint, 4, args=(out, args.samples, args.stop_after), deadline=120.0
    )
    after = run_ranks(resume, 2, args=(out, args.samples), deadline=120.0)

    delivered = collections.Counter(i for ids in before for i in ids)
    delivered.update(i for _, rest, _ in after for i in rest)
    twice = sorted(i for i, n in delivered.items() if n > 1)
    never = args.samples - len(delivered)
    # What the restored epoch leaves unread, as the source reports it: the same on any rank.
    report = DatasetSource(
        make_dataset(args.samples), seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=2, seed=1
    )
    report.load_state_dict(_position(args.samples, args.stop_after))
    remainder = report.report.num_dropped_samples
    print(
        f"4 ranks trained {args.stop_after} steps ({sum(map(len, before))} samples), "
        f"checkpointed with dcp.save; 2 ranks resumed at step {after[0][0]} and finished "
        f"the epoch ({sum(len(rest) for _, rest, _ in after)} samples)"
    )
    print(
        f"epoch 0: {len(delivered)} of {args.samples} samples delivered, {len(twice)} twice; "
        f"{never} never delivered, the documented remainder is {remainder}"
    )
    fresh = DatasetSource(
        make_dataset(args.samples), seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=2, seed=1
    )
    fresh.set_epoch(1)
    print(f"epoch 1: {after[0][2]} steps per rank, as a 2-rank run: {len(fresh)}")
    return 0 if not twice and never == remainder and after[0][2] == len(fresh) else 1


def _position(samples: int, steps: int) -> dict[str, Any]:
    """The source state 4 ranks reach after ``steps`` steps (any rank's: it is global)."""
    source = DatasetSource(
        make_dataset(samples), seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=4, seed=1
    )
    for _, _ in zip(range(steps), source, strict=False):
        pass
    return source.state_dict()


if __name__ == "__main__":
    raise SystemExit(main())
