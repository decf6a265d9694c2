"""What the transform-worker tests share: a randomized transform whose result carries an array
large enough to come back through shared memory, one that hangs on a chosen sample, a pack
that checks both and returns ``(id, noise, array value)``, a loader over a Gloo group, a
check that processes are gone, and an epoch that fails in the workers with the check that
every rank failed together.

The transforms are module-level functions so that worker processes can import them."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

#: Elements of the array each transformed sample carries: a chunk of samples is larger than
#: the shared-memory threshold, so results come back through shared memory.
ARRAY = 4096


def noisy(sample: dict[str, Any], rng: np.random.Generator, bad: int = -1) -> dict[str, Any]:
    """A randomized transform: noise from ``rng`` and an array filled from it."""
    if sample["id"] == bad:
        raise ValueError("this sample cannot be transformed")
    return {
        "id": sample["id"],
        "input_ids": sample["input_ids"],
        "noise": float(rng.random()),
        "array": np.full(ARRAY, rng.integers(1 << 40), dtype=np.int64),
    }


def stuck(sample: dict[str, Any], rng: np.random.Generator, bad: int = -1) -> dict[str, Any]:
    """:func:`noisy`, except that sample ``bad`` never finishes in time (a hung worker)."""
    if sample["id"] == bad:
        time.sleep(120)
    return noisy(sample, rng)


def pack_noisy(samples: list[dict[str, Any]], seq_len: int) -> list[tuple[int, float, int]]:
    """``(id, noise, array value)`` of each transformed sample, checking capacity and array."""
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    out = []
    for s in samples:
        array = s["array"]
        assert array.shape == (ARRAY,) and (array == array[0]).all()
        out.append((int(s["id"]), s["noise"], int(array[0])))
    return out


def gloo_loader(source: Any, *, seq_len: int, timeout: float = 30.0, depth: int = 2) -> Any:
    """A two-bin loader of ``source`` over a Gloo group of the world, packing with
    :func:`pack_noisy` (``close_timeout=2``)."""
    from evenflow.engine import BalancedLoader, LoaderConfig
    from evenflow.transports import GlooTransport

    config = LoaderConfig(
        seq_len=seq_len,
        bins_per_rank=2,
        prefetch_depth=depth,
        log_stats=False,
        timeout=timeout,
        close_timeout=2.0,
    )
    return BalancedLoader(
        source,
        config=config,
        transport=GlooTransport(timeout=30.0),
        metadata_fn=source.metadata_fn,
        pack_fn=pack_noisy,
        cost_model="quadratic",
    )


def gone(pids: list[int]) -> bool:
    """Whether none of ``pids`` is a live process."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def failing_epoch(
    loader: Any, source: Any, *, rank: int, kill: bool, epoch: int | None = None
) -> dict[str, Any]:
    """Run an epoch that must fail in the transform workers (with ``kill``, rank 0 SIGKILLs
    its first worker by pid after two steps); what this rank delivered and raised, and whether
    every worker it saw is gone."""
    delivered, pids = 0, set()
    try:
        with loader:
            if epoch is not None:
                loader.set_epoch(epoch)
            for _ in loader:
                delivered += 1
                pids.update(source.worker_pids)
                if kill and delivered == 2 and rank == 0:
                    os.kill(source.worker_pids[0], signal.SIGKILL)
        error: BaseException | None = None
    except Exception as exc:
        error = exc
    pids.update(source.worker_pids)
    assert error is not None, "the epoch did not fail"
    return {
        "delivered": delivered,
        "type": type(error).__name__,
        "text": "\n".join([str(error), *getattr(error, "__notes__", [])]),
        "step": getattr(error, "step", None),
        "pids": sorted(pids),
        "gone": gone(sorted(pids)),
    }


def failed_together(results: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """Check that every rank stopped at the same step (the peers' errors naming it) and
    reaped its workers; the step, and the results of the ranks that raised their own error."""
    steps = {r["delivered"] for r in results}
    assert len(steps) == 1, results  # every rank stopped at the same step
    (step,) = steps
    own = [r for r in results if r["type"] != "RemoteStageError"]
    assert len(own) >= 1, results
    for r in results:
        if r["type"] == "RemoteStageError":
            assert r["step"] == step, r  # the peer's error names the step
        assert r["pids"] and r["gone"], r  # the workers are reaped: no orphan
    return step, own
