"""Toy step sources whose samples name themselves, loader groups over them, thread runners.

Every sample is ``{"id": (rank, step, i), "epoch": e, "input_ids": array}`` whose tokens all
equal ``rank * 1000 + i``, so :func:`id_pack` can check both where a sample came from and that
its payload survived the exchange, and return just the ids for conservation checks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.transports import InProcessGroup

SEQ_LEN = 64
DEADLINE = 20.0  # seconds a test waits for its ranks

#: ``sizes(rank, step, epoch)`` -> the token count of each sample, bin by bin.
Sizes = Callable[[int, int, int], list[list[int]]]


def id_sample(rank: int, step: int, i: int, length: int, epoch: int = 0) -> dict[str, Any]:
    return {
        "id": (rank, step, i),
        "epoch": epoch,
        "input_ids": np.full(length, rank * 1000 + i, dtype=np.int32),
    }


def id_bins(rank: int, step: int, sizes: list[list[int]], epoch: int = 0) -> list[list[Any]]:
    """One step's bins of :func:`id_sample` samples, numbered across the step."""
    out, i = [], 0
    for bin_sizes in sizes:
        b = []
        for length in bin_sizes:
            b.append(id_sample(rank, step, i, length, epoch))
            i += 1
        out.append(b)
    return out


class IdSource:
    """A deterministic rank-local source with an epoch, a read count and failure hooks.

    ``fail_at``: reading that step raises ``ValueError``. ``block_at``: reading that step waits
    for ``gate`` (at most ``DEADLINE`` seconds), which models a source stuck on storage; tests
    open the gate before they return.
    """

    def __init__(
        self,
        rank: int,
        sizes: Sizes,
        *,
        num_steps: int = 6,
        fail_at: int | None = None,
        block_at: int | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.rank, self.sizes, self.num_steps = rank, sizes, num_steps
        self.fail_at, self.block_at, self.gate = fail_at, block_at, gate
        self.epoch = 0
        self.reads = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
        for step in range(self.num_steps):
            if self.fail_at == step:
                raise ValueError(f"source broke on rank {self.rank}")
            if step == self.block_at and self.gate is not None:
                self.gate.wait(DEADLINE)
            self.reads += 1
            yield id_bins(self.rank, step, self.sizes(self.rank, step, self.epoch), self.epoch)


def _check_payload(samples: list[dict[str, Any]], seq_len: int) -> None:
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    for s in samples:
        rank, _, i = s["id"]
        assert np.all(np.asarray(s["input_ids"]) == rank * 1000 + i), "payload corrupted"


def id_pack(samples: list[dict[str, Any]], seq_len: int) -> list[tuple[int, int, int]]:
    """Pack to ``(rank, step, index)`` ids, checking capacity and payload integrity."""
    _check_payload(samples, seq_len)
    return [tuple(s["id"]) for s in samples]


def id_epoch_pack(samples: list[dict[str, Any]], seq_len: int) -> list[tuple[int, int, int, int]]:
    """Like :func:`id_pack`, with the epoch: ``(rank, step, index, epoch)``."""
    _check_payload(samples, seq_len)
    return [(*s["id"], s["epoch"]) for s in samples]


def make_loaders(
    n: int,
    sources: Sequence[Any],
    *,
    group: InProcessGroup | None = None,
    per_rank: Callable[[int], dict[str, Any]] | None = None,
    pack_fn: Callable[[list[Any], int], Any] = id_pack,
    **overrides: Any,
) -> list[BalancedLoader]:
    """One loader per rank of an in-process group over ``sources``.

    Keyword arguments that name ``LoaderConfig`` fields configure the loaders (defaults:
    ``seq_len=SEQ_LEN``, ``bins_per_rank=2``, ``log_stats=False``); the others go to every
    ``BalancedLoader``, and ``per_rank(rank)`` adds rank-specific ones.
    """
    group = group or InProcessGroup(n, timeout=DEADLINE)
    fields = LoaderConfig.__dataclass_fields__
    cfg: dict[str, Any] = {"seq_len": SEQ_LEN, "bins_per_rank": 2, "log_stats": False}
    cfg.update({k: overrides.pop(k) for k in list(overrides) if k in fields})
    config = LoaderConfig(**cfg)
    loaders = []
    for r in range(n):
        kwargs: dict[str, Any] = {"pack_fn": pack_fn, "cost_model": "quadratic", **overrides}
        if per_rank is not None:
            kwargs.update(per_rank(r))
        loaders.append(
            BalancedLoader(sources[r], config=config, transport=group.transport(r), **kwargs)
        )
    return loaders


def run_in_threads(
    loaders: Sequence[BalancedLoader],
    body: Callable[[int, BalancedLoader], Any],
    *,
    deadline: float = DEADLINE,
    release: Callable[[], None] | None = None,
) -> tuple[list[Any], list[BaseException | None], list[bool]]:
    """Run ``body`` for every rank on its own thread; return results, errors and who hung.

    After the deadline ``release`` (e.g. opening a gate) runs and every loader is closed from
    this thread, which cancels a blocked ``next()``; so nothing outlives the test.
    """
    results: list[Any] = [None] * len(loaders)
    errors: list[BaseException | None] = [None] * len(loaders)

    def main(rank: int) -> None:
        try:
            results[rank] = body(rank, loaders[rank])
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(len(loaders))]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    hung = [t.is_alive() for t in threads]
    if release is not None:
        release()
    for loader in loaders:
        with contextlib.suppress(Exception):
            loader.close()
    for t in threads:
        t.join(DEADLINE)
    return results, errors, hung


def run_in_threads_or_raise(
    loaders: Sequence[BalancedLoader],
    body: Callable[[int, BalancedLoader], Any],
    *,
    deadline: float = 60.0,
) -> list[Any]:
    """:func:`run_in_threads`, raising the first rank's error and failing on a hung rank."""
    results, errors, hung = run_in_threads(loaders, body, deadline=deadline)
    assert not any(hung), f"ranks hung: {[r for r, h in enumerate(hung) if h]}"
    for error in errors:
        if error is not None:
            raise error
    return results


def evenflow_threads(before: set[threading.Thread] | None = None) -> list[str]:
    """Names of live evenflow threads, leaving out those in ``before`` (earlier tests')."""
    ignore = before or set()
    return sorted(
        t.name for t in threading.enumerate() if t not in ignore and t.name.startswith("evenflow")
    )


async def record_pass(
    loader: BalancedLoader, flat: Callable[[Any], Any]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Iterate ``loader`` to the end of its pass: ``flat(batch)`` of every delivered batch and
    the state saved right after each (the states a resume test restores from)."""
    batches, states = [], []
    async with loader:
        async for batch in loader:
            batches.append(flat(batch))
            states.append(loader.state_dict())
    return batches, states
