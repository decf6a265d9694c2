"""``evenflow bench exchange``: payload exchange throughput on Gloo over loopback, and payload
mode against shared-dataset mode on the same steps.

On the same ranks, in one run, with the same locally generated payloads (packed-sequence
samples: 512-32k int32 tokens, as many int32 labels and a small dict each), every one bound
for another rank as a moved sample is (a sample that stays never enters the exchange), it
times:

* **evenflow**: ``GlooTransport.exchange_sized``, the engine's path: ONE uint8
  ``all_to_all_single`` whose splits every rank knows from the frame sizes the metadata round
  carried (write the frames, the collective, decode every frame, thread hop). The payloads
  are prepared for the wire beforehand, as the pipeline does when it reads a sample (that
  cost is reported on its own, as "prepare");
* **two-step**: ``GlooTransport.exchange``, the sizes-first protocol for callers that cannot
  know the sizes (an int64 sizes collective, then the data collective): the engine's path
  before frame sizes travelled with the metadata;
* **raw reused**: a bare ``all_to_all_single`` moving the same number of payload bytes
  between tensors allocated once and reused every call, the floor for any design on Gloo;
* **raw fresh**: the same with a new output tensor per call, as a user's own call would do;
* **gather + raw**: each peer-bound token and label array copied into its place in the reused
  send buffer, then the raw call: the least any design must do with ``all_to_all_single``,
  which takes one contiguous buffer. ``vs gather`` shows how much of that floor evenflow's
  framing (headers, validation, decoding, thread hop) leaves;
* **pickled**: ``all_gather_object`` of each rank's whole outgoing dict, every rank keeping
  its share: the naive approach.

Each timed call starts after a garbage collection and a barrier, in an order that changes
every repeat so that every method follows every other equally often; a repeat's
time is the slowest rank's, and repeat 0 (the warm-up of every method) is dropped. Reported
figures are medians over repeats of payload bytes sent per rank per second; evenflow's
frames carry a few extra header bytes that the figures do not credit. Targets: evenflow at
least 90% of gather + raw at >= 16 MiB per rank on 2 ranks, and at least 4x the pickled
baseline at 4 ranks.

**Modes** (``--modes-steps``, 0 skips it): the same ``DatasetSource`` steps through a
``BalancedLoader`` on the same ranks, in payload mode and in shared-dataset mode
(``shared=True``), with no training step in between: the loader's steps per second, the
payload bytes each rank sends per step (counted at the transport) and the exchange
collectives per step.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._sources.dataset import DatasetSource
from evenflow.engine._tools.bench._verdict import add_report_only, targets_status
from evenflow.transports import GlooTransport, Prepared, Transport, encode_many, prepare
from evenflow.transports.internal import pack_outgoing
from evenflow.transports.launch import run_ranks
from evenflow.transports.testing import WrappedTransport

_MIB = 1 << 20
_GATHER_TARGET = 0.90
_TARGET_MIB = 16
_GATHER_TARGET_RANKS = 2
_PICKLE_TARGET = 4.0
_PICKLE_TARGET_RANKS = 4


def _payload(
    rank: int, num_ranks: int, total_bytes: int, seed: int
) -> tuple[dict[int, list[tuple[Hashable, Any]]], list[int]]:
    """Samples worth ``total_bytes`` of arrays, dealt round-robin to the other ranks.

    Only peers: the engine never exchanges a sample with its own rank (one that stays is
    packed where it was read, see ``rank_routes``), so a self-bound share would time copies
    that no step makes, in every method alike."""
    rng = np.random.default_rng(seed * 1009 + rank)
    outgoing: dict[int, list[tuple[Hashable, Any]]] = {t: [] for t in range(num_ranks)}
    per_target = [0] * num_ranks
    made, index = 0, 0
    while made < total_bytes:
        length = int(rng.integers(512, 32 * 1024 + 1))
        length = max(1, min(length, (total_bytes - made) // 8))
        tokens = rng.integers(0, 128_000, size=length, dtype=np.int32)
        sample = {
            "tokens": tokens,
            "labels": np.roll(tokens, -1),
            "meta": {"source": "web", "doc": index, "length": length, "weight": 1.0},
        }
        target = (rank + 1 + index % (num_ranks - 1)) % num_ranks
        outgoing[target].append(((rank, index), sample))
        per_target[target] += 8 * length
        made += 8 * length
        index += 1
    return outgoing, per_target


_METHODS = ("evenflow", "two_step", "raw_reused", "raw_fresh", "gather_raw", "pickled")


async def _measure_size(
    transport: Any, rank: int, num_ranks: int, *, mib: int, repeats: int, seed: int
) -> dict[str, Any]:
    """Time the four methods on one payload size, interleaved, in every rank."""
    import torch
    import torch.distributed as dist

    world = dist.group.WORLD
    outgoing, per_target = _payload(rank, num_ranks, mib * _MIB, seed + mib)
    packed = pack_outgoing(rank, outgoing)
    two_step_wire = sum(encode_many([packed[t] for t in sorted(packed)])[1])
    # What the pipeline does when it reads a sample: prepare it for the wire (timed apart).
    for _ in range(2):  # the second round is timed: the first pays one-off warm-up costs
        started = time.perf_counter()
        sized = {t: [(k, prepare(value)) for k, value in items] for t, items in outgoing.items()}
        prepare_s = time.perf_counter() - started
    wire_bytes = sum(p.nbytes for items in sized.values() for _, p in items)
    # What the metadata round tells every receiver: the keys and frame sizes it gets.
    announced = await transport.all_gather(
        {
            str(t): [[key for key, _ in items], [p.nbytes for _, p in items]]
            for t, items in sized.items()
        }
    )
    expected_in = {
        sender: list(zip(table[str(rank)][0], table[str(rank)][1], strict=True))
        for sender, table in enumerate(announced)
        if table[str(rank)][0]
    }
    sizes = torch.tensor(per_target, dtype=torch.int64)
    incoming = torch.empty(num_ranks, dtype=torch.int64)
    dist.all_to_all_single(incoming, sizes, group=world)
    split_in = incoming.tolist()
    send = torch.ones(sum(per_target), dtype=torch.uint8)
    recv = torch.empty(sum(split_in), dtype=torch.uint8)

    async def evenflow() -> None:
        received = await transport.exchange_sized(sized, expected_in)
        del received

    async def two_step() -> None:
        received = await transport.exchange(outgoing)
        del received

    async def raw_reused() -> None:
        dist.all_to_all_single(recv, send, split_in, per_target, group=world)

    async def raw_fresh() -> None:
        # What a user's own call would do: a new output tensor every time.
        out = torch.empty(sum(split_in), dtype=torch.uint8)
        dist.all_to_all_single(out, send, split_in, per_target, group=world)

    # Where each peer-bound array goes in the send buffer: target segments in rank order,
    # each sample's tokens then labels, as _payload counted them.
    send_bytes = send.numpy()
    gathers: list[tuple[np.ndarray, np.ndarray]] = []
    segment = 0
    for target in range(num_ranks):
        offset = segment
        for _, sample in outgoing[target]:
            for name in ("tokens", "labels"):
                array = sample[name]
                if target != rank:
                    gathers.append(
                        (send_bytes[offset : offset + array.nbytes], array.view(np.uint8))
                    )
                offset += array.nbytes
        assert offset - segment == per_target[target]  # the layout _payload counted
        segment += per_target[target]

    async def gather_raw() -> None:
        for place, array in gathers:
            np.copyto(place, array)
        dist.all_to_all_single(recv, send, split_in, per_target, group=world)

    async def pickled() -> None:
        # Benchmark-only baseline: it pickles data this benchmark generated itself on its
        # own ranks. evenflow never unpickles anything a peer sent.
        gathered: list[Any] = [None] * num_ranks
        dist.all_gather_object(gathered, outgoing, group=world)
        mine = [item for sent in gathered for item in sent[rank]]
        del gathered, mine

    methods = dict(
        zip(
            _METHODS,
            (evenflow, two_step, raw_reused, raw_fresh, gather_raw, pickled),
            strict=True,
        )
    )
    rows: dict[str, list[float]] = {name: [] for name in _METHODS}
    for repeat in range(repeats + 1):  # repeat 0 warms every method up and is dropped
        for name in _order(_METHODS, repeat):
            # No method pays for the garbage of the one before it (the pickled baseline
            # leaves megabytes of it).
            gc.collect()
            dist.barrier(group=world)
            start = time.perf_counter()
            await methods[name]()
            elapsed = time.perf_counter() - start
            if repeat:
                rows[name].append(elapsed)
    return {
        "bytes": sum(per_target),
        "wire_bytes": wire_bytes,
        "two_step_wire_bytes": two_step_wire,
        "prepare_s": prepare_s,
        "seconds": rows,
    }


def _order(methods: Sequence[str], repeat: int) -> list[str]:
    """The order of ``methods`` in ``repeat``: rows of a Williams Latin square.

    A method's time depends on what ran just before it (caches, freed memory, Gloo's
    buffers). Rotating one fixed order would keep every method's predecessor the same; in
    these rows (for an even count) every method follows every other exactly once per
    ``len(methods)`` repeats, and holds every position once."""
    n = len(methods)
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    return [methods[(index + repeat) % n] for index in first]


def _rank_main(
    rank: int, num_ranks: int, sizes_mib: list[int], repeats: int, seed: int
) -> dict[str, Any]:
    """Runs on every rank: times every method for every size."""
    import torch

    torch.set_num_threads(1)

    async def measure() -> dict[str, Any]:
        transport = GlooTransport(timeout=120.0)
        try:
            return {
                str(mib): await _measure_size(
                    transport, rank, num_ranks, mib=mib, repeats=repeats, seed=seed
                )
                for mib in sizes_mib
            }
        finally:
            await transport.aclose()

    return asyncio.run(measure())


def _summarize(
    num_ranks: int, sizes_mib: Sequence[int], per_rank: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    rows = []
    for mib in sizes_mib:
        entries = [r[str(mib)] for r in per_rank]
        sent = statistics.mean(e["bytes"] for e in entries)
        wire = statistics.mean(e["wire_bytes"] for e in entries)
        prepare_s = max(e["prepare_s"] for e in entries)
        row: dict[str, Any] = {
            "num_ranks": num_ranks,
            "mib_per_rank": mib,
            "bytes_per_rank": sent,
            "wire_overhead": wire / sent - 1.0,
            "prepare_bytes_per_s": sent / prepare_s if prepare_s > 0 else float("inf"),
        }
        for method in _METHODS:
            # A collective ends when its slowest rank does.
            series = [e["seconds"][method] for e in entries]
            slowest = [max(times) for times in zip(*series, strict=True)]
            row[f"{method}_bytes_per_s"] = sent / statistics.median(slowest)
        # Targets compare against the faster raw figure, whichever buffer policy that is.
        row["raw_bytes_per_s"] = max(row["raw_reused_bytes_per_s"], row["raw_fresh_bytes_per_s"])
        row["vs_raw"] = row["evenflow_bytes_per_s"] / row["raw_bytes_per_s"]
        row["vs_pickled"] = row["evenflow_bytes_per_s"] / row["pickled_bytes_per_s"]
        row["vs_gather"] = row["evenflow_bytes_per_s"] / row["gather_raw_bytes_per_s"]
        row["vs_two_step"] = row["evenflow_bytes_per_s"] / row["two_step_bytes_per_s"]
        row["two_step_vs_gather"] = row["two_step_bytes_per_s"] / row["gather_raw_bytes_per_s"]
        row["gather_vs_raw"] = row["gather_raw_bytes_per_s"] / row["raw_bytes_per_s"]
        rows.append(row)
    return rows


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    targets = []
    for row in rows:
        case = f"{row['num_ranks']} ranks, {row['mib_per_rank']} MiB/rank"
        if row["mib_per_rank"] >= _TARGET_MIB and row["num_ranks"] == _GATHER_TARGET_RANKS:
            ok = row["vs_gather"] >= _GATHER_TARGET
            targets.append(
                {
                    "target": f"evenflow >= {_GATHER_TARGET:.0%} of gather + raw",
                    "case": case,
                    "value": row["vs_gather"],
                    "threshold": _GATHER_TARGET,
                    "status": "PASS" if ok else "MISS",
                }
            )
        if row["num_ranks"] == _PICKLE_TARGET_RANKS:
            ok = row["vs_pickled"] >= _PICKLE_TARGET
            targets.append(
                {
                    "target": f"evenflow >= {_PICKLE_TARGET:g}x pickled all_gather_object",
                    "case": case,
                    "value": row["vs_pickled"],
                    "threshold": _PICKLE_TARGET,
                    "status": "PASS" if ok else "MISS",
                }
            )
    return targets


def _print_table(rows: list[dict[str, Any]], targets: list[dict[str, Any]], repeats: int) -> None:
    print(
        f"Payload exchange on Gloo over loopback: median of {repeats} repeats, payload bytes "
        f"sent per rank per second (GB/s = 1e9 B/s)."
    )
    print(
        "evenflow: exchange_sized, one collective sized from the metadata round (payloads "
        "prepared beforehand, as when the pipeline reads them; 'prepare' is that cost's "
        "throughput); two-step: exchange, sizes collective then data. raw reused / raw fresh: "
        "a bare all_to_all_single between reused buffers / into a new output tensor ('vs raw' "
        "divides by the faster). gather + raw: peer-bound arrays copied into the send buffer, "
        "then the raw call, the floor of any design built on all_to_all_single ('floor' is "
        "its share of raw; 'vs gather' evenflow's share of it, 'two-step' the two-step "
        "path's). Every method moves the same payload over the same repeats, warm-up dropped; "
        "evenflow's frames also carry headers ('wire +')."
    )
    print(
        f"{'ranks':>5} {'MiB/rank':>8} {'evenflow':>9} {'two-step':>8} {'raw reused':>10} "
        f"{'raw fresh':>9} {'gather+raw':>10} {'pickled':>8} {'prepare':>8} {'vs raw':>7} "
        f"{'floor':>6} {'vs gather':>9} {'two-step':>8} {'vs pickled':>10} {'wire +':>7}"
    )
    for row in rows:
        print(
            f"{row['num_ranks']:>5} {row['mib_per_rank']:>8} "
            f"{row['evenflow_bytes_per_s'] / 1e9:>9.2f} "
            f"{row['two_step_bytes_per_s'] / 1e9:>8.2f} "
            f"{row['raw_reused_bytes_per_s'] / 1e9:>10.2f} "
            f"{row['raw_fresh_bytes_per_s'] / 1e9:>9.2f} "
            f"{row['gather_raw_bytes_per_s'] / 1e9:>10.2f} "
            f"{row['pickled_bytes_per_s'] / 1e9:>8.2f} "
            f"{row['prepare_bytes_per_s'] / 1e9:>8.1f} {row['vs_raw']:>6.0%} "
            f"{row['gather_vs_raw']:>5.0%} {row['vs_gather']:>8.0%} "
            f"{row['two_step_vs_gather']:>7.0%} "
            f"{row['vs_pickled']:>9.1f}x {row['wire_overhead']:>6.1%}"
        )
    print("Targets:")
    if not targets:
        print(
            f"  none measured: run without --quick (they need >= {_TARGET_MIB} MiB per rank "
            f"on {_GATHER_TARGET_RANKS} ranks, or {_PICKLE_TARGET_RANKS} ranks)."
        )
    for t in targets:
        print(
            f"  {t['status']}  {t['target']} ({t['case']}): {t['value']:.2f} "
            f"(threshold {t['threshold']:g})"
        )


# -- payload mode against shared-dataset mode ---------------------------------------------------

_MODES = ("payload", "shared")
_MODES_SEQ_LEN = 8192
_MODES_BINS = 4


class _Counted(WrappedTransport):
    """Counts the exchanges and the payload bytes this rank sends to its peers."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.num_exchanges = 0
        self.bytes_sent = 0

    async def exchange_sized(self, outgoing: Any, incoming: Any) -> dict[Hashable, Any]:
        self.num_exchanges += 1
        self.bytes_sent += sum(
            p.nbytes
            for target, items in outgoing.items()
            if target != self.rank
            for _, p in items
            if isinstance(p, Prepared)
        )
        return await super().exchange_sized(outgoing, incoming)


def _modes_rank(rank: int, num_ranks: int, steps: int, seed: int) -> dict[str, Any]:
    """Runs on every rank: the same DatasetSource steps in both modes, alternately, twice."""
    import torch

    torch.set_num_threads(1)

    # One token array, sliced into samples: lognormal lengths (median ~1.1k tokens), enough
    # for ``steps`` full steps on every rank, the same on every rank (shared mode's premise).
    rng = np.random.default_rng(seed)
    need = int(1.2 * (steps + 2) * num_ranks * _MODES_BINS * _MODES_SEQ_LEN)
    lengths = np.clip(rng.lognormal(7.0, 1.0, size=need // 600).astype(np.int64), 16, 8192)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), need)) + 1]
    tokens = rng.integers(0, 32_000, size=int(lengths.sum()), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    dataset = [
        {"input_ids": tokens[a : a + n], "labels": tokens[a : a + n]}
        for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)
    ]
    config = LoaderConfig(
        seq_len=_MODES_SEQ_LEN,
        bins_per_rank=_MODES_BINS,
        prefetch_depth=2,
        max_steps=steps,
        log_stats=False,
        timeout=120.0,
    )
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in _MODES}
    for _ in range(2):
        for mode in _MODES:
            source = DatasetSource(
                dataset,
                seq_len=_MODES_SEQ_LEN,
                bins_per_rank=_MODES_BINS,
                rank=rank,
                num_ranks=num_ranks,
                seed=seed,
                lengths=lengths,
                shared=mode == "shared",
            )
            transport = _Counted(GlooTransport(timeout=120.0))
            loader = BalancedLoader(
                source, config=config, transport=transport, cost_model="quadratic"
            )
            with loader:
                iterator = iter(loader)
                next(iterator)  # the pipeline is warm from the second step on
                started = time.perf_counter()
                delivered = 1 + sum(1 for _ in iterator)
                elapsed = time.perf_counter() - started
            results[mode].append(
                {
                    "seconds_per_step": elapsed / max(delivered - 1, 1),
                    "bytes_per_step": transport.bytes_sent / delivered,
                    "exchanges_per_step": transport.num_exchanges / delivered,
                    "steps": delivered,
                }
            )
    return results


def _summarize_modes(num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in _MODES:
        runs = [r[mode] for r in per_rank]
        # A step ends when the slowest rank's does; the faster of the two passes counts.
        seconds = min(max(run[i]["seconds_per_step"] for run in runs) for i in range(2))
        rows.append(
            {
                "num_ranks": num_ranks,
                "mode": mode,
                "steps": runs[0][0]["steps"],
                "steps_per_s": 1.0 / seconds,
                "bytes_per_step_per_rank": statistics.mean(
                    run[-1]["bytes_per_step"] for run in runs
                ),
                "exchanges_per_step": runs[0][-1]["exchanges_per_step"],
            }
        )
    return rows


def _print_modes(rows: list[dict[str, Any]]) -> None:
    print()
    print(
        f"Payload mode vs shared-dataset mode: the same DatasetSource steps (seq_len="
        f"{_MODES_SEQ_LEN}, {_MODES_BINS} bins per rank, int32 input_ids and labels) through a "
        "BalancedLoader on Gloo, no training step; bytes: payload bytes each rank sends its "
        "peers per step."
    )
    print(
        f"{'ranks':>5} {'mode':>8} {'steps':>5} {'steps/s':>8} {'MiB/step/rank':>13} "
        f"{'exch/step':>9}"
    )
    for row in rows:
        print(
            f"{row['num_ranks']:>5} {row['mode']:>8} {row['steps']:>5} "
            f"{row['steps_per_s']:>8.1f} {row['bytes_per_step_per_rank'] / _MIB:>13.2f} "
            f"{row['exchanges_per_step']:>9.2f}"
        )


def _positive_int(text: str) -> int:
    if "," in text:  # every evenflow command takes lists as separate values
        spaced = " ".join(part.strip() for part in text.split(","))
        raise argparse.ArgumentTypeError(
            f"lists are space-separated, as in every evenflow command: write {spaced}, not {text}."
        )
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}.")
    return value


def main(argv: Sequence[str] | None = None, prog: str = "evenflow bench exchange") -> int:
    """Run the benchmark; print a table (or JSON with ``--json``). Returns 0, or 1 when a
    target was missed (0 with ``--report-only``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1 MiB, 2 repeats")
    parser.add_argument(
        "--ranks", type=_positive_int, nargs="+", default=None, help="world sizes (default 2 4)"
    )
    parser.add_argument(
        "--sizes-mib",
        type=_positive_int,
        nargs="+",
        default=None,
        help="payload sizes per rank in MiB (default 1 4 16 64)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats per case (default 25: on a shared 2-core machine single repeats "
        "vary by +-30%%, and fewer made the 90%% verdict a coin toss)",
    )
    parser.add_argument("--seed", type=int, default=0, help="payload seed (default 0)")
    parser.add_argument(
        "--modes-steps",
        type=int,
        default=None,
        help="steps of the payload vs shared-dataset comparison (0 skips it; default 24, 4 "
        "with --quick)",
    )
    add_report_only(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    ranks = args.ranks or ([2] if args.quick else [2, 4])
    if min(ranks) < 2:
        parser.error(
            f"--ranks must all be >= 2 (an exchange moves samples between ranks), got "
            f"{' '.join(map(str, ranks))}."
        )
    sizes = args.sizes_mib or ([1] if args.quick else [1, 4, 16, 64])
    repeats = args.repeats or (2 if args.quick else 25)
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}.")
    modes_steps = args.modes_steps if args.modes_steps is not None else (4 if args.quick else 24)
    if modes_steps < 0:
        parser.error(f"--modes-steps must be >= 0, got {modes_steps}.")

    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for num_ranks in ranks:
        per_rank = run_ranks(
            _rank_main,
            num_ranks,
            args=(sizes, repeats, args.seed),
            deadline=900.0,
            timeout=300.0,
        )
        rows.extend(_summarize(num_ranks, sizes, per_rank))
    modes: list[dict[str, Any]] = []
    if modes_steps:
        for num_ranks in ranks:
            per_rank = run_ranks(
                _modes_rank, num_ranks, args=(modes_steps, args.seed), deadline=900.0, timeout=300.0
            )
            modes.extend(_summarize_modes(num_ranks, per_rank))
    targets = _targets(rows)
    if args.json:
        document = {
            "benchmark": "exchange",
            "repeats": repeats,
            "ranks": ranks,
            "sizes_mib": sizes,
            "seconds": time.perf_counter() - started,
            "results": rows,
            "modes": modes,
            "targets": targets,
        }
        print(json.dumps(document, indent=2))
    else:
        _print_table(rows, targets, repeats)
        if modes:
            _print_modes(modes)
    named = [{"name": f"{t['target']} ({t['case']})", "status": t["status"]} for t in targets]
    return targets_status(named, report_only=args.report_only, prog=prog)
