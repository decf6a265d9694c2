"""``evenflow bench transforms``: heavy per-sample transforms in threads or worker processes.

Two Gloo ranks train a small model with DDP (``DistributedDataParallel`` over Gloo) on a
map-style dataset whose per-sample transform is pure-Python CPU work (a loop calibrated to
``W`` ms per sample on this machine, holding the GIL as a tokenizer or a chat template in
Python does). For each work level the arms run in the same rank processes, alternated (each
arm once per round):

* ``dataloader-N``: ``torch.utils.data.DataLoader(num_workers=N)`` with a
  ``DistributedSampler`` and a fixed number of samples per step, no balancing (its workers
  start with ``forkserver``, as the training process runs threads);
* ``threads``: evenflow, ``DatasetSource(transform=..., transform_workers=0)``: the read and
  the transform on the loader's threads, inside the training process;
* ``workers-N``: evenflow with ``transform_workers=N`` worker processes;
* ``stream-N`` (with ``--stream``): evenflow over an ``IterableSource`` of the same raw
  samples (this rank's share, as a list) with ``transform_workers=N``: the stream is iterated
  and packed in the training process and each step's raw samples go to the workers.

Figures per arm (median over rounds; within a round, the steps after the first ``_WARMUP``,
as a mean: queues filled during the warm-up, by the DataLoader's ``2·N`` batches and
evenflow's ``2·N`` steps read ahead alike, are drained over many steps, so a run needs many
more steps than ``2·N`` to show the steady state):
step time, throughput (samples per second) and its ratio to ``dataloader-N`` at equal N (per
sample, since a DataLoader step holds a fixed number of samples and an evenflow step as many
as its packed bins hold), data stall (time the training loop
waits for the batch over step time), the training process's CPU time outside the training
step per step (``time.process_time`` minus the training thread's ``time.thread_time`` inside
the step: every other thread of the process, including Gloo's own C++ threads, which run
without the GIL), the **GIL time** of the data path per step (the CPU time of the process's
Python threads other than the training thread, each read from its own CPU clock
(``pthread_getcpuclockid``), plus the training thread's CPU time inside ``next()``: a Python
thread runs Python only while it holds the GIL, so this bounds the time the data path held it,
counting only system calls that release it besides), and transform throughput scaling
(throughput against one worker).

The host's core count is printed: with 2 ranks on a 2-core machine, worker processes still
compete with the training processes for the same cores, so scaling beyond one worker per
rank cannot show there; on a GPU host the compute does not use those cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._sources.dataset import DatasetSource
from evenflow.engine._sources.iterable import IterableSource
from evenflow.engine._sources.workers import start_context
from evenflow.engine._tools.bench._verdict import add_report_only, targets_status
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError
from evenflow.transports import GlooTransport
from evenflow.transports.launch import LaunchError, run_ranks

__all__ = ["burn", "main"]

_SEQ_LEN = 256
_BINS = 2
_WARMUP = 3
_VOCAB = 512


def burn(sample: dict[str, Any], rng: np.random.Generator, loops: int = 0) -> dict[str, Any]:
    """The benchmark's transform: ``loops`` iterations of pure-Python work, then the tokens
    as an int64 array (``rng`` draws one token, so the random state is exercised)."""
    acc = 0
    for i in range(loops):
        acc = (acc * 31 + i) & 0xFFFF
    ids = np.asarray(sample["input_ids"], dtype=np.int64)
    ids[0] = int(rng.integers(_VOCAB))
    return {"input_ids": ids, "acc": acc}


def _loops_per_ms() -> float:
    """Iterations of :func:`burn`'s loop per millisecond on this machine (best of three)."""
    best = float("inf")
    loops = 200_000
    for _ in range(3):
        started = time.perf_counter()
        burn({"input_ids": [1]}, np.random.default_rng(0), loops)
        best = min(best, time.perf_counter() - started)
    return loops / (best * 1e3)


class _Data:
    """A map-style dataset whose ``__getitem__`` applies the transform (the DataLoader arm)
    or returns the raw sample (evenflow applies ``transform`` itself)."""

    def __init__(self, lengths: list[int], loops: int, transformed: bool) -> None:
        self.lengths = lengths
        self.loops = loops
        self.transformed = transformed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = {"input_ids": [(i + k) % _VOCAB for k in range(self.lengths[i])]}
        if not self.transformed:
            return sample
        return burn(sample, np.random.default_rng([0, 0, i]), self.loops)


def _rows(samples: list[dict[str, Any]], rows: int) -> Any:
    """Pack samples greedily into ``rows`` rows of ``_SEQ_LEN`` tokens (truncating)."""
    import torch

    out = torch.zeros(rows, _SEQ_LEN, dtype=torch.int64)
    row, at = 0, 0
    for s in samples:
        ids = torch.from_numpy(np.asarray(s["input_ids"], dtype=np.int64))
        if at + len(ids) > _SEQ_LEN:
            row, at = row + 1, 0
        if row >= rows:
            break
        n = min(len(ids), _SEQ_LEN - at)
        out[row, at : at + n] = ids[:n]
        at += n
    return out


#: Samples evenflow's pack_fn has packed in this rank process (samples per step).
_PACKED = [0]


def _pack(samples: list[dict[str, Any]], seq_len: int) -> Any:
    _PACKED[0] += len(samples)
    return _rows(samples, 1)[0]


def _num_tokens(sample: dict[str, Any]) -> int:
    return len(sample["input_ids"])


def _collate_dataloader(samples: list[dict[str, Any]]) -> Any:
    return _rows(samples, _BINS)


class _ThreadClocks:
    """CPU seconds the process's Python threads other than the calling one used since the
    last :meth:`lap`, each from its own CPU clock. A thread that ended between two laps loses
    its last lap's time (the loader's threads live as long as the loader)."""

    def __init__(self) -> None:
        self._me = threading.get_ident()
        self._seen: dict[int, float] = {}

    def lap(self) -> float:
        used = 0.0
        now: dict[int, float] = {}
        for thread in threading.enumerate():
            ident = thread.ident
            if ident is None or ident == self._me:
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, ValueError):  # ended since enumerate()
                continue
            now[ident] = cpu
            used += cpu - self._seen.get(ident, 0.0)
        self._seen = now
        return used


def _bench_rank(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    # The source's "transforms were the bottleneck" WARNING is expected in most arms here.
    logging.getLogger("evenflow").setLevel(logging.ERROR)
    start_context()  # one fork server, preloaded, for the DataLoader's workers and evenflow's
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Embedding(_VOCAB, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    lengths = np.random.default_rng(1).integers(16, _SEQ_LEN // 2, size=spec["samples"]).tolist()
    per_step = max(1, round(_BINS * _SEQ_LEN / float(np.mean(lengths)) * 0.9))
    steps = spec["steps"]

    def train(batch: Any) -> float:
        cpu = time.thread_time()
        x = batch if isinstance(batch, torch.Tensor) else torch.stack(list(batch))
        loss = ddp(x.reshape(-1, _SEQ_LEN)).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.thread_time() - cpu

    def timed(batches: Any) -> dict[str, Any]:
        dist.barrier()
        walls, waits, other_cpu, gil = [], [], [], []
        it = iter(batches)
        clocks = _ThreadClocks()
        clocks.lap()
        for _ in range(steps):
            t0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
            batch = next(it)
            t1, in_next = time.perf_counter(), time.thread_time() - c0
            train_cpu = train(batch)
            walls.append(time.perf_counter() - t0)
            waits.append(t1 - t0)
            other_cpu.append(time.process_time() - p0 - train_cpu)
            gil.append(clocks.lap() + in_next)
        walls, waits = walls[_WARMUP:], waits[_WARMUP:]
        other_cpu, gil = other_cpu[_WARMUP:], gil[_WARMUP:]
        step = sum(walls) / len(walls)
        return {
            "step_time_s": step,
            "data_stall": sum(waits) / sum(walls),
            "other_cpu_ms": 1e3 * statistics.median(other_cpu),
            "gil_ms": 1e3 * statistics.median(gil),
            "samples_per_s": None,
        }

    results: dict[str, list[dict[str, Any]]] = {}
    for work_ms in spec["work_ms"]:
        loops = round(work_ms * spec["loops_per_ms"])
        transform = functools.partial(burn, loops=loops)
        for _ in range(spec["rounds"]):
            for arm in spec["arms"]:
                kind, _, n = arm.partition("-")
                key = f"{work_ms:g}ms/{arm}"
                if kind == "dataloader":
                    from torch.utils.data import DataLoader, DistributedSampler

                    data = _Data(lengths, loops, transformed=True)
                    sampler = DistributedSampler(data, num_ranks, rank, shuffle=True, seed=0)
                    # torch warns when N exceeds the core count: the arms compare N anyway.
                    warnings.filterwarnings("ignore", "This DataLoader will create")
                    loader = DataLoader(
                        data,
                        batch_size=per_step,
                        sampler=sampler,
                        num_workers=int(n),
                        collate_fn=_collate_dataloader,
                        multiprocessing_context="forkserver",
                        prefetch_factor=2,
                    )
                    out = timed(loader)
                    out["samples_per_step"] = per_step
                    del loader
                else:
                    raw = _Data(lengths, loops, transformed=False)
                    workers = 0 if kind == "threads" else int(n)
                    source: Any
                    if kind == "stream":
                        source = IterableSource(
                            [raw[i] for i in range(rank, len(raw), num_ranks)],
                            length_fn=_num_tokens,
                            seed=0,
                            transform=transform,
                            transform_workers=workers,
                        )
                    else:
                        source = DatasetSource(
                            raw, seed=0, transform=transform, transform_workers=workers
                        )
                    config = LoaderConfig(
                        seq_len=_SEQ_LEN,
                        bins_per_rank=_BINS,
                        prefetch_depth=2,
                        log_stats=False,
                        max_steps=steps,
                    )
                    ev = BalancedLoader(
                        source,
                        config=config,
                        transport=GlooTransport(timeout=60.0),
                        pack_fn=_pack,
                        cost_model="quadratic",
                    )
                    _PACKED[0] = 0
                    with ev:
                        out = timed(ev)
                    out["samples_per_step"] = _PACKED[0] / steps
                out["samples_per_s"] = out["samples_per_step"] / out["step_time_s"]
                results.setdefault(key, []).append(out)
    return {
        "cases": {
            key: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
            for key, runs in results.items()
        }
    }


def _summarize(spec: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for key in ranks[0]["cases"]:
        per_rank = [r["cases"][key] for r in ranks]
        cases[key] = {
            "step_time_s": max(c["step_time_s"] for c in per_rank),
            "data_stall": max(c["data_stall"] for c in per_rank),
            "other_cpu_ms": max(c["other_cpu_ms"] for c in per_rank),
            "gil_ms": max(c["gil_ms"] for c in per_rank),
            "samples_per_s": min(c["samples_per_s"] for c in per_rank),
        }
    for work in spec["work_ms"]:
        for arm in spec["arms"]:
            case = cases[f"{work:g}ms/{arm}"]
            n = arm.partition("-")[2]
            ref = cases.get(f"{work:g}ms/dataloader-{n}") if n else None
            # Per sample, not per step: a DataLoader step holds a fixed sample count, an
            # evenflow step as many as its bins hold.
            case["vs_dataloader"] = (
                None if ref is None else case["samples_per_s"] / ref["samples_per_s"]
            )
            kind = arm.partition("-")[0]
            one = cases.get(f"{work:g}ms/{kind}-1")
            case["scaling_vs_1"] = (
                None
                if one is None or kind not in ("workers", "stream")
                else (case["samples_per_s"] / one["samples_per_s"])
            )
    return cases


def _targets(spec: dict[str, Any], cases: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    heavy = max(spec["work_ms"])
    for arm in spec["arms"]:
        if not arm.startswith(("workers", "stream")):
            continue
        case = cases[f"{heavy:g}ms/{arm}"]
        ratio = case["vs_dataloader"]
        if ratio is not None:
            targets.append(
                {
                    "name": f"{arm} vs dataloader, samples/s at {heavy:g} ms/sample (>= 0.98x)",
                    "value": ratio,
                    "status": "PASS" if ratio >= 0.98 else "MISS",
                }
            )
        targets.append(
            {
                "name": f"{arm}: data path's GIL time <= 5 ms/step at {heavy:g} ms/sample",
                "value": case["gil_ms"],
                "status": "PASS" if case["gil_ms"] <= 5.0 else "MISS",
            }
        )
    return targets


def _print_text(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    print(
        f"evenflow bench transforms: 2 Gloo ranks, DDP, {cfg['steps']} steps x {cfg['rounds']} "
        f"round(s) per arm, seq_len={_SEQ_LEN} x {_BINS} bins, host cores={cfg['cpu_count']} "
        f"(shared by both ranks, their workers and anything else running)"
    )
    print(
        f"{'case':<26}{'step ms':>9}{'vs DL*':>8}{'stall %':>9}{'CPU ms/step':>13}"
        f"{'GIL ms/step':>13}{'samples/s':>11}{'x w1':>7}"
    )
    for key, c in doc["cases"].items():
        vs = "" if c["vs_dataloader"] is None else f"{c['vs_dataloader']:.2f}"
        sc = "" if c["scaling_vs_1"] is None else f"{c['scaling_vs_1']:.2f}"
        print(
            f"{key:<26}{1e3 * c['step_time_s']:>9.1f}{vs:>8}{100 * c['data_stall']:>9.1f}"
            f"{c['other_cpu_ms']:>13.2f}{c['gil_ms']:>13.2f}{c['samples_per_s']:>11.1f}{sc:>7}"
        )
    print("* vs DL: samples/s over the DataLoader arm's at equal N (same work level)")
    print(
        "CPU ms/step: every thread but the training step's (Gloo's C++ threads included); "
        "GIL ms/step: the Python threads' CPU besides the training step (the data path's "
        "GIL time, bounded above)"
    )
    for t in doc["targets"]:
        print(f"{t['status']:<5} {t['name']}: {t['value']:.2f}")
    print(f"wall {doc['wall_s']:.0f} s")


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Step time, data stall and training-process CPU with heavy per-sample "
        "transforms: torch DataLoader(num_workers=N) against evenflow threads and evenflow "
        "worker processes, 2 Gloo ranks training a small DDP model.",
    )
    parser.add_argument("--quick", action="store_true", help="one work level, few steps")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--work-ms",
        type=float,
        nargs="+",
        default=None,
        help="per-sample transform work levels in ms (default 0 2 10 20; 2 with --quick)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=None,
        help="worker counts N compared (default 1 2 4; 1 with --quick)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per arm (default 60, 8 with --quick)"
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="also run stream-N: an IterableSource with N transform workers",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="alternated rounds (default 2, 1 with --quick)"
    )
    parser.add_argument(
        "--deadline", type=float, default=900.0, help="seconds before the ranks are killed"
    )
    add_report_only(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "evenflow bench transforms") -> int:
    """Run the benchmark; 0 when every target passed, 1 on a MISS (unless ``--report-only``)
    or a failure, 2 on bad input."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    work = args.work_ms if args.work_ms is not None else ([2.0] if args.quick else [0, 2, 10, 20])
    workers = args.workers if args.workers is not None else ([1] if args.quick else [1, 2, 4])
    steps = args.steps if args.steps is not None else (8 if args.quick else 60)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 2)
    try:
        check_int("--steps", steps, minimum=_WARMUP + 2)
        check_int("--rounds", rounds, minimum=1)
        for w in work:
            check_number("--work-ms", w, minimum=0.0)
        for n in workers:
            check_int("--workers", n, minimum=1)
        check_number("--deadline", args.deadline, minimum=0.0, strict_minimum=True)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    arms = ["threads"]
    for n in workers:
        arms += [f"dataloader-{n}", f"workers-{n}"] + ([f"stream-{n}"] if args.stream else [])
    spec = {
        "work_ms": [float(w) for w in work],
        "arms": arms,
        "steps": steps,
        "rounds": rounds,
        "samples": 4000,
        "loops_per_ms": _loops_per_ms(),
    }
    started = time.perf_counter()
    try:
        ranks = run_ranks(_bench_rank, 2, args=[spec], deadline=args.deadline, timeout=60.0)
    except LaunchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    cases = _summarize(spec, ranks)
    doc: dict[str, Any] = {
        "benchmark": "transforms",
        "config": {**spec, "cpu_count": os.cpu_count(), "quick": args.quick},
        "cases": cases,
        "targets": _targets(spec, cases),
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_text(doc)
    return targets_status(doc["targets"], report_only=args.report_only, prog=prog)


if __name__ == "__main__":
    raise SystemExit(main())
