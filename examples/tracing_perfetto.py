"""Tracing the pipeline: per-rank Chrome traces, one merged Perfetto file, and the summary.

What it shows:

* ``Tracer(chrome=..., jsonl=...)``: one tracer per loader (per rank); every stage of every
  step becomes a span (``read``, ``gather``, ``plan``, ``exchange``, ``pack``) and the loader
  adds the caller's side (``wait`` inside ``next()``, ``compute`` between two ``next()``);
* the files: ``trace-rank<r>.json`` (Chrome trace, written when the loader closes) and
  ``trace-rank<r>.jsonl`` (one JSON object per span) in the output directory;
* ``merge_chrome_traces``: every rank's trace on one timeline, one process track per rank.
  Open ``merged.json`` at https://ui.perfetto.dev or in ``chrome://tracing``;
* ``loader.trace_summary()``: count, total, p50, p99 and max time per stage, and the data
  stall (the fraction of the loop's time spent waiting for data).

The ranks are threads of this process (``InProcessGroup``); the training step is simulated
with a short sleep. Run it with::

    python examples/tracing_perfetto.py --out traces

Options: ``--out DIR`` (default ``./evenflow-traces``), ``--ranks N`` (default 2),
``--steps N`` (default 8), ``--compute-ms MS`` (default 5).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from evenflow.engine import BalancedLoader, LoaderConfig, Tracer, merge_chrome_traces
from evenflow.transports import InProcessTransport
from evenflow.transports.testing import run_inprocess_threads


def steps_for(rank: int, num_steps: int) -> list[list[list[Any]]]:
    """Two bins per step of int32 token arrays; rank 0 holds the long samples."""
    rng = np.random.default_rng(rank)
    lengths = [400, 380] if rank == 0 else [80, 120, 60, 100]
    return [
        [[rng.integers(0, 1000, n, dtype=np.int32) for n in lengths] for _ in range(2)]
        for _ in range(num_steps)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("evenflow-traces"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=5.0)
    args = parser.parse_args(argv)

    async def rank_main(transport: InProcessTransport) -> dict[str, Any]:
        tracer = Tracer(chrome=args.out, jsonl=args.out)
        config = LoaderConfig(seq_len=1024, bins_per_rank=2, log_stats=False)
        loader = BalancedLoader(
            steps_for(transport.rank, args.steps),
            config=config,
            transport=transport,
            tracer=tracer,
        )
        async with loader:
            async for _batch in loader:
                time.sleep(args.compute_ms / 1e3)  # the training step (blocks, as compute does)
        # Closing the loader closed the tracer, which wrote the Chrome trace.
        return {"summary": loader.trace_summary(), "chrome": str(tracer.chrome_path)}

    results = run_inprocess_threads(args.ranks, rank_main, deadline=120.0, timeout=30.0)

    merged = merge_chrome_traces([r["chrome"] for r in results], args.out / "merged.json")
    events = json.loads(merged.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    print(f"merged {len(results)} traces into {merged} ({len(spans)} spans)")

    summary = results[0]["summary"]
    print("rank 0, per stage (ms):   count   total     p50     p99     max")
    for stage, row in summary["stages"].items():
        print(
            f"  {stage:<20} {row['count']:>7} {row['total'] * 1e3:>7.1f} "
            f"{row['p50'] * 1e3:>7.2f} {row['p99'] * 1e3:>7.2f} {row['max'] * 1e3:>7.2f}"
        )
    caller = summary["caller"]
    print(
        f"rank 0 data stall: {caller['data_stall_fraction']:.1%} of the loop's time. This "
        "example's compute is a toy of a few milliseconds, so waiting for data dominates; "
        "with a real training step the pipeline runs ahead (`evenflow bench pipeline` "
        "measures it with realistic step times)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
