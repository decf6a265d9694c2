"""Balance-window helpers: a window planner that moves every sample to another step of its
window, a long-tailed step source, and the rank functions of the Gloo resume test.

:func:`rotating_plan_window` plans step ``first + i`` of a window of ``L`` steps with the
samples read in step ``first + (i - 1) % L`` (each step planned by the ordinary planner), so
every sample of a window of two or more steps trains in a step it was not read in. It is a
test double that forces cross-step payload routing, whatever the real window planner decides.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine._planning.columns import StepColumns

SEQ_LEN = 64
STEPS = 8


def rotating_plan_window(planner: Any, columns: Sequence[StepColumns], first: int) -> Any:
    """The window's plans (``.plans``, all the pipeline reads of a window plan)."""
    n = len(columns)
    plans = []
    for i in range(n):
        read = (i - 1) % n
        c = columns[read]
        moved = dataclasses.replace(c, key_step=np.full(c.num_samples, first + read))
        plans.append(planner.plan_arrays(moved, first + i))
    return types.SimpleNamespace(plans=tuple(plans))


def use_rotating_planner() -> None:
    """Make the pipeline of this process plan windows with :func:`rotating_plan_window`."""
    from evenflow.engine._pipeline import plan_stage

    plan_stage.plan_window = rotating_plan_window  # type: ignore[assignment]


def step_bins(rank: int, step: int, epoch: int = 0) -> list[list[dict[str, Any]]]:
    """Two bins of samples ``{"id": [rank, step, i], "input_ids": ...}``; one rank in four
    holds an outlier (a sample of 40-60 tokens) at each step, so steps are outlier-bound."""
    rng = np.random.default_rng([rank, epoch, step])
    bins, i = [], 0
    for b in range(2):
        long = b == 0 and rank == (step + epoch) % 4
        sizes = [int(rng.integers(40, 60))] if long else rng.integers(2, 16, size=3).tolist()
        out = []
        for n in sizes:
            out.append({"id": [rank, step, i], "input_ids": np.full(n, rank * 100 + i, np.int32)})
            i += 1
        bins.append(out)
    return bins


class WindowSource:
    """``steps`` steps of :func:`step_bins`; with ``stateful`` it has ``state_dict`` /
    ``load_state_dict`` (else a resume re-reads and discards steps)."""

    def __init__(self, rank: int, steps: int = STEPS) -> None:
        self.rank, self.steps, self.epoch, self.position = rank, steps, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
        while self.position < self.steps:
            step = self.position
            self.position += 1
            yield step_bins(self.rank, step, self.epoch)


class StatefulWindowSource(WindowSource):
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def ids_pack(samples: list[dict[str, Any]], seq_len: int) -> list[list[int]]:
    """Pack to the samples' ``[rank, step, i]`` ids, checking capacity and payloads."""
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    for s in samples:
        rank, _, i = s["id"]
        assert np.all(s["input_ids"] == rank * 100 + i), "payload corrupted"
    return [list(map(int, s["id"])) for s in samples]


def gloo_loader(rank: int, stateful: bool, window: int, depth: int) -> BalancedLoader:
    from evenflow.transports import GlooTransport

    source = (StatefulWindowSource if stateful else WindowSource)(rank)
    config = LoaderConfig(
        seq_len=SEQ_LEN,
        bins_per_rank=2,
        prefetch_depth=depth,
        balance_window=window,
        log_stats=False,
    )
    return BalancedLoader(
        source,
        config=config,
        transport=GlooTransport(timeout=10.0),
        pack_fn=ids_pack,
        cost_model="quadratic",
    )


def record_rank(rank: int, num_ranks: int, window: int) -> dict[str, Any]:
    """Per source kind: every batch of one pass and the state saved after each."""
    use_rotating_planner()
    out: dict[str, Any] = {}
    for stateful in (True, False):
        with gloo_loader(rank, stateful, window, depth=2) as loader:
            batches, states = [], []
            for batch in loader:
                batches.append(batch)
                states.append(loader.state_dict())
        out["stateful" if stateful else "stateless"] = {"batches": batches, "states": states}
    return out


def resume_rank(
    rank: int, num_ranks: int, window: int, states: dict[str, list[list[Any]]]
) -> dict[str, list[Any]]:
    """For each kind and each saved state of this rank: the rest of the pass, restored in this
    (fresh) process with another prefetch depth."""
    use_rotating_planner()
    tails: dict[str, list[Any]] = {}
    for kind, saved in states.items():
        tails[kind] = []
        for state in saved[rank]:
            loader = gloo_loader(rank, kind == "stateful", window, depth=1)
            loader.load_state_dict(state)
            with loader:
                tails[kind].append(list(loader))
    return tails
