"""``evenflow demo``: train a tiny transformer on N local ranks, balancing off and on, side by side.

The demo spawns N processes (``transports.launch.run_ranks``: a wall-clock deadline, so it can
never hang), each one a data-parallel rank of a real training job on Gloo over loopback
(:mod:`.rank`). The data is real text, the Python standard library's own sources as bytes
(:mod:`.data`), read through ``DatasetSource`` and packed the Hugging Face way; the model is a
small causal transformer whose attention runs per sample (:mod:`.model`), so a packed
sequence's cost depends on its samples' lengths as a real model's does; the planner balances
a cost model fitted to timings taken on this machine at start-up (:mod:`.calibrate`). Compute
is measured, never simulated.

Every arm (balancing off, balanced per step, and a balance window where the loader has one)
trains the same steps from the same initial weights, taking turns step by step. The parent
merges the per-rank Chrome traces, writes ``report.json`` and a plot (with matplotlib) and
prints the report (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evenflow.engine._config import LoaderConfig
from evenflow.engine._tools.demo.rank import rank_main
from evenflow.engine._tools.demo.report import build_report, format_report, write_outputs
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError
from evenflow.transports.launch import LaunchError, RankDeadlineError, RankFailedError, run_ranks

__all__ = ["core_warning", "main", "usable_cores"]

_ALGORITHMS = ("default", "refine", "lpt")
_COST_MODELS = ("calibrated", "flops", "quadratic", "tokens")
_HEADS = 4


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def core_warning(ranks: int, cores: int) -> str | None:
    """The warning for more ranks than cores (then each rank's timings include the others')."""
    if ranks <= cores:
        return None
    return (
        f"{ranks} ranks on {cores} CPU core(s): the ranks take turns on the cores, so step "
        "times include waiting for a core and the measured speedup is not what separate "
        f"devices would see; use --ranks {cores} or fewer for a fair measurement."
    )


def _has_window() -> bool:
    return "balance_window" in LoaderConfig.__dataclass_fields__


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Train a tiny transformer on N local ranks (Gloo over loopback) on the Python "
            "standard library's sources, with balancing off and on, taking turns step by "
            "step, and report what balancing changed."
        ),
    )
    cores = usable_cores()
    default_ranks = max(2, cores)
    parser.add_argument(
        "--ranks",
        type=int,
        default=default_ranks,
        help=f"number of ranks (default: one per CPU core, at least 2; here {default_ranks})",
    )
    parser.add_argument("--steps", type=int, default=96, help="training steps per arm (default 96)")
    parser.add_argument(
        "--seq-len", type=int, default=1024, help="tokens per packed sequence (default 1024)"
    )
    parser.add_argument(
        "--bins-per-rank",
        type=int,
        default=1,
        help="packed sequences (microbatches) per rank per step (default 1: the shape where "
        "one step's plan has least room and a balance window most)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=4,
        help="steps planned together by the balance-window arm (default 4)",
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
        help="what the planner balances (default: calibrated, forward+backward seconds fitted "
        "to timings taken on this machine at start-up)",
    )
    parser.add_argument("--hidden-size", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="data and weight seed (default 0)")
    parser.add_argument(
        "--thread-nice",
        type=int,
        default=19,
        help="LoaderConfig.thread_nice of every arm's loader: its pipeline threads yield the "
        "CPU to training, as spare cores would let them (default 19; 0 leaves them alone)",
    )
    parser.add_argument(
        "--out", default="./evenflow-out", help="output directory (default ./evenflow-out)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        help="seconds after which every rank is killed, start-up included (default 300)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    check_int("--ranks", args.ranks, minimum=2)
    check_int("--steps", args.steps, minimum=2)
    check_int("--seq-len", args.seq_len, minimum=16)
    check_int("--bins-per-rank", args.bins_per_rank, minimum=1)
    check_int("--window", args.window, minimum=2)
    check_int("--hidden-size", args.hidden_size, minimum=_HEADS)
    check_int("--layers", args.layers, minimum=1)
    check_number("--lr", args.lr, minimum=0.0, strict_minimum=True)
    check_int("--seed", args.seed, minimum=0)
    if check_int("--thread-nice", args.thread_nice, minimum=0) > 19:
        raise ConfigError(
            f"--thread-nice must be at most 19 (the lowest priority), but got "
            f"{args.thread_nice}; pass 0 to leave the pipelines' threads alone."
        )
    check_number("--deadline", args.deadline, minimum=0.0, strict_minimum=True)
    if args.hidden_size % _HEADS:
        raise ConfigError(
            f"--hidden-size must be a multiple of {_HEADS} (the model has {_HEADS} heads), but "
            f"got {args.hidden_size!r}; try {args.hidden_size - args.hidden_size % _HEADS}."
        )


def _prepare_out(out: Path) -> Path:
    """Create ``--out`` and check it takes files; a ConfigError naming the option otherwise."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".evenflow-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--out {str(out)!r} cannot hold the demo's files ({exc.strerror or exc}); pass "
            "--out with a directory you can write to."
        ) from None
    return out


def _deadline_message(args: argparse.Namespace, phase_file: Path, started: float) -> str:
    """What the ranks were doing when the deadline passed, and what to change."""
    elapsed = time.perf_counter() - started
    try:
        stamp, text = phase_file.read_text(encoding="utf-8").splitlines()[:2]
        since = time.time() - float(stamp)
    except (OSError, ValueError):
        return (
            f"the deadline of {args.deadline:g} s passed after {elapsed:.1f} s while the ranks "
            "were still starting (spawning processes, importing torch, joining the process "
            "group); nothing was stuck, start-up was slower than the deadline. Raise --deadline "
            "(the default is 300)."
        )
    return (
        f"the deadline of {args.deadline:g} s passed after {elapsed:.1f} s; rank 0 was last "
        f"{text.strip().rstrip('. ')} ({since:.1f} s before). Raise --deadline, or lower "
        "--steps or --seq-len for a shorter run."
    )


def _spec(args: argparse.Namespace, out: Path, cores: int) -> dict[str, Any]:
    arms = ["off", "step", *(["window"] if _has_window() else [])]
    return {
        "steps": args.steps,
        "seq_len": args.seq_len,
        "bins_per_rank": args.bins_per_rank,
        "window": args.window,
        "arms": arms,
        "algorithm": args.algorithm,
        "cost_model": args.cost_model,
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "heads": _HEADS,
        "lr": args.lr,
        "seed": args.seed,
        "out": str(out),
        "phase_file": str(out / ".phase"),
        "tty": sys.stderr.isatty(),
        "timeout": 60.0,
        "cores": cores,
        # One intra-op thread a rank, like one device a rank: a rank's compute is then the CPU
        # time of its training thread, which the demo measures beside the wall time.
        "threads_per_rank": 1,
        "thread_nice": args.thread_nice,
    }


def main(argv: Sequence[str] | None = None, prog: str = "evenflow demo") -> int:
    """Run the demo; 0 on success, 1 when the run failed, 2 on bad arguments."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    try:
        _check_args(args)
        out = _prepare_out(Path(args.out).resolve())
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    cores = usable_cores()
    spec = _spec(args, out, cores)
    warnings = [w for w in (core_warning(args.ranks, cores),) if w]
    for line in warnings:
        print(f"{prog}: warning: {line}", file=sys.stderr)
    Path(spec["phase_file"]).unlink(missing_ok=True)
    arms = " / ".join(spec["arms"])
    print(
        f"{prog}: starting {args.ranks} ranks (Gloo over loopback); each trains {args.steps} "
        f"steps of every arm ({arms}), one step of each in turn, on the Python standard "
        "library's sources ...",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    try:
        results = run_ranks(
            rank_main, args.ranks, args=[spec], deadline=args.deadline, timeout=spec["timeout"]
        )
        report = build_report(spec, args.ranks, results, wall_s=time.perf_counter() - started)
        report["warnings"] = warnings + report["warnings"]
        write_outputs(report, out)
    except RankDeadlineError:
        message = _deadline_message(args, Path(spec["phase_file"]), started)
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1
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
    finally:
        Path(spec["phase_file"]).unlink(missing_ok=True)
    if args.json:
        import json

        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0
