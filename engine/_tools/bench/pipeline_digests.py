"""Pipeline digests of seeded Gloo runs: whether two builds of the pipeline behave alike.

A restructuring of the pipeline that claims to keep its behaviour must deliver the same
batches, plan the same steps, record the same spans and issue the same collectives. This module
runs a fixed set of configurations on 2 and 4 real Gloo ranks (the project's launcher) over a
seeded synthetic dataset built here, and prints one line per fact:

* per configuration, epoch, step and rank: a digest of the batch (every tensor's dtype, shape
  and bytes, keys sorted) and the step's plan digest (``StepStats.digest``);
* per configuration and rank: for each trace stage, the steps of its spans in the order that
  stage recorded them (names and steps only: times, queue depths and the interleaving of
  stages running on different threads are not deterministic and are left out);
* per configuration and rank: every collective call in order, with its operation and what it
  carried (structure, sizes and a digest of the content), never its timing.

Configurations: payload and shared-dataset mode (``DatasetSource(shared=True)``), a balance
window, ``objective="lockstep"``, leader planning and a device depth (``device_prefetch_depth=1``
on a stand-in accelerator that acts on the host, so that a CPU-only machine runs the device
path: slots, pinning, the ``h2d`` stage). Each runs two epochs and then a fresh loader restored
from a state saved mid-way through the second epoch, which replays the tail.

It uses only long-standing public entry points (``BalancedLoader``, ``LoaderConfig``,
``DatasetSource``, ``Tracer``, ``GlooTransport``, ``WrappedTransport``), so another build can run
it unchanged: run it once with each build's package first on the path and compare::

    PYTHONPATH=<old checkout>/.shim python3 pipeline_digests.py --out old.txt
    PYTHONPATH=<new checkout>/.shim python3 pipeline_digests.py --out new.txt
    python3 pipeline_digests.py --compare old.txt new.txt

``--ranks 2`` runs only the 2-rank world (about half the time).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig, Tracer
from evenflow.engine._pipeline import h2d
from evenflow.engine._tools.host_device import HostDevice
from evenflow.transports import GlooTransport
from evenflow.transports.launch import run_ranks
from evenflow.transports.testing import WrappedTransport

__all__ = ["CONFIGS", "compare_lines", "main", "run_world"]

_SEQ_LEN = 64
_BINS = 2
_SAMPLES_PER_RANK = 30  # with lengths 4..40 and two 64-token bins a rank: ~6 steps an epoch
_CUT = 3  # the resumed loader restores the state saved after this many steps of epoch 1
_TIMEOUT = 20.0

#: name -> settings. ``mode``: ``payload`` or ``shared``; ``device``: run with the stand-in
#: accelerator (:func:`_stand_in_device`); the rest are ``LoaderConfig`` fields.
CONFIGS: dict[str, dict[str, Any]] = {
    "payload": {"mode": "payload"},
    "shared": {"mode": "shared"},
    "payload-window3": {"mode": "payload", "balance_window": 3},
    "shared-window2": {"mode": "shared", "balance_window": 2},
    "payload-lockstep": {"mode": "payload", "objective": "lockstep"},
    "payload-leader": {"mode": "payload", "planning": "leader", "prefetch_depth": 1},
    "payload-device1": {"mode": "payload", "device": True, "device_prefetch_depth": 1},
    "shared-device1-window2": {
        "mode": "shared",
        "device": True,
        "device_prefetch_depth": 1,
        "balance_window": 2,
    },
}


# -- digests ----------------------------------------------------------------------------------


def _feed(h: Any, obj: Any) -> None:
    """Feed ``obj``'s structure and content into hash ``h`` (dict keys sorted)."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"A{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _feed(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r}".encode())


def digest(obj: Any) -> str:
    """A short content digest of nested tensors, arrays, containers and scalars."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()[:16]


def _shape(obj: Any) -> str:
    """The structure of ``obj``: container shapes, array dtypes and shapes (no content)."""
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return f"{str(obj.dtype).replace('torch.', '')}{list(obj.shape)}"
    if isinstance(obj, dict):
        inner = ",".join(f"{k}:{_shape(obj[k])}" for k in sorted(obj, key=repr))
        return "{" + inner + "}"
    if isinstance(obj, (list, tuple)):
        return f"[{len(obj)}]"
    return type(obj).__name__


# -- the rank side ----------------------------------------------------------------------------


def _dataset(num_ranks: int, seed: int) -> list[dict[str, Any]]:
    """Self-naming samples: every token of sample ``i`` is ``i % 251``."""
    n = _SAMPLES_PER_RANK * num_ranks
    lengths = np.random.default_rng(seed).integers(4, 41, size=n)
    return [
        {"id": i, "input_ids": np.full(int(k), i % 251, dtype=np.int64)}
        for i, k in enumerate(lengths)
    ]


def _recording_transport(inner: Any) -> Any:
    """A wrapper around ``inner`` that lists every collective it issues, in order."""

    class Recording(WrappedTransport):
        name = "recording"

        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.calls: list[str] = []

        async def all_gather(self, obj: Any) -> list[Any]:
            self.calls.append(f"all_gather {_shape(obj)} {digest(obj)}")
            return await self.inner.all_gather(obj)

        async def broadcast(self, obj: Any, *, src: int) -> Any:
            what = f"{_shape(obj)} {digest(obj)}" if self.rank == src else "-"
            self.calls.append(f"broadcast src={src} {what}")
            return await self.inner.broadcast(obj, src=src)

        async def exchange(self, outgoing: Any) -> dict[Hashable, Any]:
            routes = {t: [(k, v) for k, v in items] for t, items in outgoing.items()}
            self.calls.append(
                f"exchange out={ {t: len(v) for t, v in sorted(routes.items())} } {digest(routes)}"
            )
            return await self.inner.exchange(outgoing)

        async def exchange_sized(self, outgoing: Any, incoming: Any) -> dict[Hashable, Any]:
            out = {t: (len(v), sum(p.nbytes for _, p in v)) for t, v in sorted(outgoing.items())}
            into = {s: (len(v), sum(n for _, n in v)) for s, v in sorted(incoming.items())}
            values = {t: [(k, p.value) for k, p in v] for t, v in outgoing.items()}
            self.calls.append(f"exchange_sized out={out} in={into} {digest(values)}")
            return await self.inner.exchange_sized(outgoing, incoming)

    return Recording(inner)


def _stand_in_device() -> None:
    """Give this rank process a host stand-in for an accelerator (:class:`HostDevice`); pinning
    becomes a copy, as a CPU-only build of torch cannot pin."""
    import torch

    if not hasattr(h2d, "_load_device_module"):
        raise RuntimeError(
            "evenflow.engine._pipeline.h2d has no _load_device_module, the hook through which "
            "this tool gives the loader a stand-in accelerator; update _stand_in_device() to "
            "the build's hook (the device-prefetch tests use the same one)."
        )
    h2d._load_device_module = lambda device: HostDevice()
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self.clone()  # type: ignore[method-assign]


def _keep(batch: Any, device: Any) -> Any:
    """``move_fn`` of the stand-in device: the batch stays on the host."""
    return batch


def _loader(name: str, rank: int, num_ranks: int, seed: int) -> tuple[Any, Any, Any]:

    settings = dict(CONFIGS[name])
    mode = settings.pop("mode")
    device = settings.pop("device", False)
    source = DatasetSource(
        _dataset(num_ranks, seed),
        seq_len=_SEQ_LEN,
        bins_per_rank=_BINS,
        rank=rank,
        num_ranks=num_ranks,
        seed=seed,
        shared=mode == "shared",
        read_threads=2,
    )
    transport = _recording_transport(GlooTransport(timeout=_TIMEOUT))
    tracer = Tracer()
    config = LoaderConfig(
        seq_len=_SEQ_LEN, bins_per_rank=_BINS, log_stats=False, timeout=_TIMEOUT, **settings
    )
    loader = BalancedLoader(
        source,
        config=config,
        transport=transport,
        metadata_fn=source.metadata_fn,
        cost_model="quadratic",
        device="cuda:0" if device else None,
        move_fn=_keep if device else None,
        tracer=tracer,
    )
    return loader, transport, tracer


def _trace_lines(prefix: str, tracer: Any) -> list[str]:
    """Per stage, the steps of its spans in that stage's own order (no times)."""
    by_stage: dict[str, list[int]] = {}
    for span in tracer.spans():
        by_stage.setdefault(span.stage, []).append(span.step)
    return [f"{prefix}/trace/{stage} {steps}" for stage, steps in sorted(by_stage.items())]


def _step_line(prefix: str, batch: Any, loader: Any) -> str:
    stats = loader.last_stats
    return f"{prefix} batch={digest(batch)} plan={stats.digest} step={stats.step}"


def _run_config(name: str, rank: int, num_ranks: int, seed: int) -> list[str]:
    head = f"{num_ranks}r/{name}/r{rank}"
    lines: list[str] = []
    state = None
    loader, transport, tracer = _loader(name, rank, num_ranks, seed)
    with loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            for i, batch in enumerate(loader):
                lines.append(_step_line(f"{head}/e{epoch}/s{i}", batch, loader))
                if epoch == 1 and i + 1 == _CUT:
                    state = loader.state_dict()
    lines += _trace_lines(head, tracer)
    lines += [f"{head}/call{k} {c}" for k, c in enumerate(transport.calls)]
    if state is None:
        raise RuntimeError(
            f"Configuration {name!r} on {num_ranks} ranks delivered fewer than {_CUT} steps in "
            "epoch 1, so there is no state to resume from; raise _SAMPLES_PER_RANK."
        )
    loader, transport, tracer = _loader(name, rank, num_ranks, seed)
    loader.load_state_dict(state)
    with loader:
        for i, batch in enumerate(loader):
            lines.append(_step_line(f"{head}/resume/s{_CUT + i}", batch, loader))
    lines += _trace_lines(f"{head}/resume", tracer)
    lines += [f"{head}/resume/call{k} {c}" for k, c in enumerate(transport.calls)]
    return lines


def _rank_main(rank: int, num_ranks: int, names: list[str], seed: int) -> dict[str, list[str]]:
    """Every named configuration on this world, one after another (plain-data result)."""
    import torch

    torch.set_num_threads(1)
    if any(CONFIGS[name].get("device") for name in names):
        _stand_in_device()
    return {name: _run_config(name, rank, num_ranks, seed) for name in names}


# -- the driver -------------------------------------------------------------------------------


def run_world(
    num_ranks: int, names: Sequence[str], *, seed: int = 3, deadline: float = 120.0
) -> list[str]:
    """The digest lines of ``names`` on ``num_ranks`` fresh Gloo ranks, rank by rank per
    configuration (so the output does not depend on which rank finished first)."""

    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(
            f"names holds unknown configurations {unknown}; choose from {sorted(CONFIGS)}."
        )
    results = run_ranks(
        _rank_main, num_ranks, args=[list(names), seed], deadline=deadline, timeout=_TIMEOUT
    )
    return [line for name in names for r in range(num_ranks) for line in results[r][name]]


def compare_lines(old: Sequence[str], new: Sequence[str]) -> tuple[int, list[str]]:
    """The number of differing facts and a readable report (at most 20 shown).

    Every line is ``KEY VALUE`` with a unique key (configuration, rank, epoch, step, stage or
    call number), so facts are matched by key: an extra or missing step or collective counts
    once instead of shifting every line after it.
    """
    old_map, new_map = _keyed(old, "OLD"), _keyed(new, "NEW")
    report: list[str] = []
    differ = 0
    for key in [*old_map, *(k for k in new_map if k not in old_map)]:
        a, b = old_map.get(key), new_map.get(key)
        if a == b:
            continue
        differ += 1
        if differ <= 20:
            report.append(f"- {key} {a if a is not None else '(absent)'}")
            report.append(f"+ {key} {b if b is not None else '(absent)'}")
    report.append(f"{len(old_map)} vs {len(new_map)} facts compared, {differ} differ")
    return differ, report


def _keyed(lines: Sequence[str], which: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if key in out:
            raise ValueError(
                f"The {which} digests hold the key {key!r} twice; they are not the output of "
                "this tool (or were concatenated): compare two single runs."
            )
        out[key] = value
    return out


def _compare(old_path: str, new_path: str) -> int:
    with open(old_path) as f:
        old = [line for line in f.read().splitlines() if not line.startswith("#")]
    with open(new_path) as f:
        new = [line for line in f.read().splitlines() if not line.startswith("#")]
    count, report = compare_lines(old, new)
    print("\n".join(report))
    return 1 if count else 0


def _lines(worlds: Sequence[int], deadline: float) -> Iterator[str]:
    for n in worlds:
        yield from run_world(n, list(CONFIGS), deadline=deadline)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the digests to this file (default: stdout)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two outputs")
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[2, 4], choices=[2, 4], help="world sizes"
    )
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds per world")
    args = parser.parse_args(argv)
    if args.compare:
        return _compare(*args.compare)
    t0 = time.perf_counter()
    lines = list(_lines(args.ranks, args.deadline))
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    print(
        f"# {len(lines)} lines, worlds {args.ranks}, {len(CONFIGS)} configurations, "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
