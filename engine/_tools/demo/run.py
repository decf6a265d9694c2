"""``evenflow demo``: train a tiny transformer on N local ranks, with and without balancing.

The demo spawns N processes (``transports.launch.run_ranks``: a wall-clock deadline, so it can
never hang), each one a data-parallel rank of a real training job on Gloo over loopback. Every
rank reads its own steps (a seeded synthetic workload, or the Python standard library's own
source files tokenized as bytes), runs them through a :class:`BalancedLoader` and trains
:class:`TinyCausalLM` on them: forward, backward, a DDP-style gradient all-reduce over the
default process group (the training group; the loader moves data on a group of its own) and an
AdamW step. Compute is measured, never simulated.

The same steps are trained twice from the same initial weights, side by side: one step with
``balance=False`` (every rank trains what it read), then the same step balanced, and so on, so
that a machine whose speed drifts slows both runs alike. Step 0 of each run is a warm-up and
is left out of the averages. The parent merges the per-rank Chrome traces, writes
``report.json`` and a PNG plot (when matplotlib is installed) and prints the report.

Cost model: by default (``--cost-model calibrated``) every rank times forward + backward per
sample at six lengths up to ``seq_len`` before training (also the warm-up), the ranks average
the timings over the training group (so every rank plans with the same numbers) and the planner
interpolates that table (:class:`MeasuredCost`). On a CPU, attention over long samples costs far
more than its FLOP count suggests (the ``L x L`` scores stop fitting in cache), so the FLOPs
model (``--cost-model flops``) balances worse here than it would on an accelerator.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._planning.cost import QuadraticCost, TokenCost
from evenflow.engine._planning.flops import FlopsCost
from evenflow.engine._tools.demo.model import (
    MeasuredCost,
    TinyCausalLM,
    TinyConfig,
    packed_loss,
    time_per_sample,
)
from evenflow.engine._tools.demo.report import build_report, format_report, write_outputs
from evenflow.engine._tracing import Tracer
from evenflow.engine._validate import check_choice, check_int, check_number
from evenflow.engine.errors import ConfigError
from evenflow.engine.workloads import (
    DISTRIBUTIONS,
    LengthMixture,
    LogNormal,
    LogUniform,
    step_source,
)
from evenflow.transports._gloo import GlooTransport
from evenflow.transports.launch import LaunchError, RankFailedError, run_ranks

__all__ = ["main", "scaled_distribution", "stdlib_source"]

_DATA = ("synthetic", "stdlib")
_ALGORITHMS = ("default", "refine", "lpt")
_COST_MODELS = ("calibrated", "flops", "quadratic", "tokens")
_RUNS = ("unbalanced", "balanced")
_VOCAB = 256  # byte-level tokens: the stdlib data is bytes, the synthetic data uses the same
_TOP_LEVEL = re.compile(rb"\n(?=(?:async def |def |class |@|if __name__))")


# -- data ---------------------------------------------------------------------------------------


def scaled_distribution(name: str, seq_len: int) -> LengthMixture:
    """The named workload distribution with every length scaled by ``seq_len / default``.

    The distributions are designed for 32k-131k token sequences; a CPU demo trains on ~2k.
    Scaling every component keeps the *shape* that makes steps imbalanced (how many samples a
    bin holds, how often a long document shows up) instead of clipping most samples to
    ``seq_len``.
    """
    check_choice("distribution", name, tuple(DISTRIBUTIONS))
    check_int("seq_len", seq_len, minimum=1)
    base = DISTRIBUTIONS[name]
    s = seq_len / base.default_seq_len
    components: list[LogNormal | LogUniform] = []
    for c in base.components:
        if isinstance(c, LogNormal):
            components.append(LogNormal(c.weight, median=c.median * s, sigma=c.sigma))
        else:
            components.append(LogUniform(c.weight, low=c.low * s, high=c.high * s))
    return LengthMixture(
        name=f"{name}@{seq_len}", components=tuple(components), default_seq_len=seq_len
    )


def _stdlib_files(seed: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages"))
        found.extend(Path(folder) / f for f in sorted(files) if f.endswith(".py"))
    order = np.random.default_rng(seed).permutation(len(found))
    return [found[i] for i in order]


def _documents(files: Sequence[Path], seq_len: int) -> Iterator[npt.NDArray[np.int32]]:
    # A document is one top-level block of a source file (a def, a class, the module header),
    # cut into pieces of at most seq_len bytes: short helpers next to seq_len-long pieces of
    # big classes give the skewed lengths real corpora have.
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for block in _TOP_LEVEL.split(data):
            tokens = np.frombuffer(block, dtype=np.uint8).astype(np.int32)
            for start in range(0, len(tokens), seq_len):
                piece = tokens[start : start + seq_len]
                if len(piece):
                    yield piece


def stdlib_source(
    *, rank: int, num_ranks: int, bins_per_rank: int, seq_len: int, num_steps: int, seed: int
) -> Iterator[list[list[dict[str, npt.NDArray[np.int32]]]]]:
    """Steps of byte-tokenized standard-library source for ``rank`` (files sharded by rank).

    First-fit packing in arrival order, like a streaming loader: a step closes at the first
    document that fits no bin, and that document opens the next step. Ends early when the
    rank's files run out (the loader then stops every rank at the same step).
    """
    files = _stdlib_files(seed)[rank::num_ranks]
    docs = _documents(files, seq_len)
    carry: npt.NDArray[np.int32] | None = None
    for _ in range(num_steps):
        bins: list[list[dict[str, npt.NDArray[np.int32]]]] = [[] for _ in range(bins_per_rank)]
        free = [seq_len] * bins_per_rank
        while True:
            doc = carry if carry is not None else next(docs, None)
            carry = None
            if doc is None:
                return
            slot = next((i for i in range(bins_per_rank) if len(doc) <= free[i]), -1)
            if slot < 0:
                carry = doc
                break
            bins[slot].append({"input_ids": doc})
            free[slot] -= len(doc)
        yield bins


# -- the rank side ------------------------------------------------------------------------------


def _progress(runs: dict[str, _Run], total: int) -> None:
    width = 24
    done = min(len(run.steps) for run in runs.values())
    filled = round(width * done / total)
    bar = "#" * filled + "-" * (width - filled)
    times = "  ".join(
        f"{name} {run.steps[-1]['step_s']:5.2f} s" for name, run in runs.items() if run.steps
    )
    line = f"  [{bar}] step {done}/{total}  last step: {times}"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line + ("\n" if done == total else ""))
    elif done == total:  # a log file gets the final line, not one line per redraw
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _cost_model(spec: dict[str, Any], model: Any, config: Any) -> tuple[Any, dict[str, Any]]:

    name = spec["cost_model"]
    if name == "tokens":
        return TokenCost(), {"name": "tokens", "formula": "L"}
    if name == "quadratic":
        quadratic = QuadraticCost()
        formula = f"{quadratic.linear:g}·L + {quadratic.quadratic:g}·L²"
        return quadratic, {"name": "quadratic", "formula": formula}
    if name == "flops":
        return FlopsCost(config.hf_config()), {"name": "flops", "formula": "FLOPs of the model"}
    import torch
    import torch.distributed as dist

    seq_len = spec["seq_len"]
    lengths = sorted({max(8, seq_len >> k) for k in range(6)})
    local = torch.tensor(time_per_sample(model, seq_len, lengths), dtype=torch.float64)
    dist.all_reduce(local)  # the training group: every rank then plans with the same table
    seconds = (local / dist.get_world_size()).tolist()
    measured = MeasuredCost(lengths, seconds)
    table = ", ".join(f"{n}: {s * 1e3:.3g}" for n, s in zip(lengths, seconds, strict=True))
    detail = {
        "name": "calibrated",
        "formula": f"measured ms per sample by length {{{table}}}, interpolated",
        "lengths": lengths,
        "seconds": seconds,
    }
    return measured, detail


def _source(spec: dict[str, Any], rank: int, num_ranks: int) -> Iterator[Any]:

    if spec["data"] == "stdlib":
        return stdlib_source(
            rank=rank,
            num_ranks=num_ranks,
            bins_per_rank=spec["bins_per_rank"],
            seq_len=spec["seq_len"],
            num_steps=spec["steps"],
            seed=spec["seed"],
        )
    return step_source(
        scaled_distribution(spec["distribution"], spec["seq_len"]),
        "firstfit",
        rank=rank,
        bins_per_rank=spec["bins_per_rank"],
        seq_len=spec["seq_len"],
        seed=spec["seed"],
        num_steps=spec["steps"],
        vocab_size=_VOCAB,
    )


class _Run:
    """One training run (balanced or not): its own model copy, optimizer, loader and tracer.

    The two runs of a demo train the same steps from the same initial weights, one step each
    in turn, so that a machine whose speed drifts (other jobs, thermal limits) slows both
    alike; each run's loader keeps prefetching while the other run trains.
    """

    def __init__(
        self, spec: dict[str, Any], name: str, rank: int, num_ranks: int, parts: dict[str, Any]
    ) -> None:
        import copy

        import torch

        self.name = name
        self.rank = rank
        self.num_ranks = num_ranks
        self.total_steps = spec["steps"]
        self.model = copy.deepcopy(parts["model"])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=3e-3, weight_decay=0.0)
        # Each run moves its data on a group of its own; every rank creates both transports
        # in the same order, as new_group requires.
        self.transport = GlooTransport(timeout=spec["timeout"])
        self.tracer = Tracer(chrome=Path(spec["out"]) / "traces" / name)
        config = LoaderConfig(
            seq_len=spec["seq_len"],
            bins_per_rank=spec["bins_per_rank"],
            balance=name == "balanced",
            max_steps=spec["steps"],
            timeout=spec["timeout"],
            log_stats=False,
        )
        self.loader = BalancedLoader(
            _source(spec, rank, num_ranks),
            config=config,
            transport=self.transport,
            cost_model=parts["cost_model"],
            algorithm=spec["algorithm"],
            tracer=self.tracer,
        )
        self.iterator = iter(self.loader)
        self.steps: list[dict[str, Any]] = []
        self.stats: list[dict[str, Any]] = []

    def train_step(self) -> bool:
        """Fetch and train one step; False when the loader has no more steps."""
        import torch
        import torch.distributed as dist

        step = len(self.steps)
        started = time.perf_counter()
        batch = next(self.iterator, None)
        if batch is None:
            return False
        t0 = time.perf_counter()
        loss_sum, tokens, samples = 0.0, 0, 0
        for packed in batch:
            logits = self.model(
                packed["input_ids"], packed["position_ids"], packed["cu_seq_lens_q"]
            )
            loss = packed_loss(logits, packed["labels"])
            (loss / len(batch)).backward()
            loss_sum += loss.item()
            tokens += int(packed["input_ids"].numel())
            samples += int(packed["cu_seq_lens_q"].numel()) - 1
        t1 = time.perf_counter()
        # DDP-style: one flat all-reduce of every gradient over the training group. It also
        # waits for the slowest rank, which is what balancing shortens.
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.num_ranks
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.tracer.add("train/forward+backward", step, t0, t1)
        self.tracer.add("train/all-reduce", step, t1, t2)
        self.tracer.add("train/optimizer", step, t2, t3)
        loss_mean = loss_sum / len(batch)
        self.steps.append(
            {
                "step": step,
                "step_s": t3 - started,
                "wait_s": t0 - started,
                "compute_s": t1 - t0,
                "sync_s": t2 - t1,
                "optimizer_s": t3 - t2,
                "loss": loss_mean,
                "tokens": tokens,
                "samples": samples,
            }
        )
        if self.loader.last_stats is not None and self.rank == 0:
            self.stats.append(self.loader.last_stats.to_dict())
        return True

    def close(self) -> dict[str, Any]:
        """Close the loader (writes this rank's Chrome trace) and return the run's record."""
        import asyncio

        try:
            self.loader.close()
        finally:
            asyncio.run(self.transport.aclose())
        wait = sum(s["wait_s"] for s in self.steps)
        busy = sum(s["step_s"] for s in self.steps)
        return {
            "steps": self.steps,
            "stats": self.stats,
            # Waiting for data over the run's own step time: the loader's own meter would
            # count the other run's steps as this run's compute.
            "data_stall_fraction": wait / busy if busy > 0 else 0.0,
            "wait_s": wait,
            "chrome": str(self.tracer.chrome_path) if self.tracer.chrome_path else None,
        }


def _rank_main(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Body of one rank (runs in a spawned process; arguments and result are plain data)."""
    import torch

    torch.set_num_threads(spec["threads_per_rank"])
    torch.manual_seed(spec["seed"])  # the same initial weights on every rank, as DDP needs
    config = TinyConfig(
        vocab_size=_VOCAB,
        hidden_size=spec["hidden_size"],
        num_layers=spec["layers"],
        num_heads=spec["heads"],
        intermediate_size=3 * spec["hidden_size"],
        max_positions=spec["seq_len"],
    )
    model = TinyCausalLM(config)
    cost_model, cost_detail = _cost_model(spec, model, config)
    parts = {"model": model, "cost_model": cost_model}
    runs: dict[str, _Run] = {}
    records: dict[str, Any] = {}
    try:
        for name in _RUNS:
            runs[name] = _Run(spec, name, rank, num_ranks, parts)
        # Every rank stops at the same step: the loaders end together (on_uneven_end="stop").
        while all([run.train_step() for run in runs.values()]):
            if rank == 0:
                _progress(runs, spec["steps"])
    finally:
        for name, run in runs.items():
            records[name] = run.close()
    return {
        "rank": rank,
        "runs": records,
        "cost_model": cost_detail,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


# -- the command --------------------------------------------------------------------------------


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Train a tiny transformer on N local ranks (Gloo over loopback), once with "
            "balancing off and once balanced, and report what balancing changed."
        ),
    )
    default_ranks = max(2, os.cpu_count() or 1)
    parser.add_argument(
        "--ranks",
        type=int,
        default=default_ranks,
        help=f"number of ranks (default: one per CPU core, at least 2; here {default_ranks})",
    )
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (default 12)")
    parser.add_argument(
        "--data",
        choices=_DATA,
        default="synthetic",
        help="synthetic lengths from --distribution, or the Python standard "
        "library's source files as bytes (default synthetic)",
    )
    parser.add_argument(
        "--distribution",
        choices=sorted(DISTRIBUTIONS),
        default="sft",
        help="length distribution of the synthetic data, scaled to --seq-len (default sft)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=1024, help="tokens per packed sequence (default 1024)"
    )
    parser.add_argument(
        "--bins-per-rank",
        type=int,
        default=4,
        help="packed sequences (microbatches) per rank per step (default 4)",
    )
    parser.add_argument(
        "--algorithm",
        choices=_ALGORITHMS,
        default="default",
        help="balancing algorithm (default: default)",
    )
    parser.add_argument(
        "--cost-model",
        choices=_COST_MODELS,
        default="calibrated",
        help="what the planner balances (default: calibrated, seconds per sample "
        "timed on this machine at start-up)",
    )
    parser.add_argument("--hidden-size", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="data and weight seed (default 0)")
    parser.add_argument(
        "--out", default="./evenflow-out", help="output directory (default ./evenflow-out)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        help="seconds after which every rank is killed (default 300)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    check_int("--ranks", args.ranks, minimum=2)
    check_int("--steps", args.steps, minimum=2)
    check_int("--seq-len", args.seq_len, minimum=16)
    check_int("--bins-per-rank", args.bins_per_rank, minimum=1)
    check_int("--hidden-size", args.hidden_size, minimum=4)
    check_int("--layers", args.layers, minimum=1)
    check_int("--seed", args.seed, minimum=0)
    check_number("--deadline", args.deadline, minimum=0.0, strict_minimum=True)
    if args.hidden_size % 4:
        raise ConfigError(
            f"--hidden-size must be a multiple of 4 (the model has 4 heads), but got "
            f"{args.hidden_size!r}."
        )


def main(argv: Sequence[str] | None = None, prog: str = "evenflow demo") -> int:
    """Run the demo; 0 on success, 1 when the run failed, 2 on bad arguments."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    try:
        _check_args(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    out = Path(args.out).resolve()
    spec = {
        "steps": args.steps,
        "data": args.data,
        "distribution": args.distribution,
        "seq_len": args.seq_len,
        "bins_per_rank": args.bins_per_rank,
        "algorithm": args.algorithm,
        "cost_model": args.cost_model,
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "heads": 4,
        "seed": args.seed,
        "out": str(out),
        "timeout": 30.0,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // args.ranks),
    }
    started = time.perf_counter()
    print(
        f"{prog}: starting {args.ranks} ranks (Gloo over loopback); each trains {args.steps} "
        "steps twice, with balancing off and balanced, one step of each in turn ...",
        file=sys.stderr,
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
        results = run_ranks(
            _rank_main, args.ranks, args=[spec], deadline=args.deadline, timeout=spec["timeout"]
        )
        report = build_report(spec, args.ranks, results, wall_s=time.perf_counter() - started)
        write_outputs(report, out)
    except RankFailedError as exc:
        what = exc.exc_type or "a crash"
        detail = exc.remote_message or str(exc)
        print(f"{prog}: error: rank {exc.rank} failed ({what}): {detail}", file=sys.stderr)
        if exc.remote_traceback:
            print(exc.remote_traceback, file=sys.stderr)
        return 1
    except (LaunchError, OSError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0
