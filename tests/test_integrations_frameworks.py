"""The framework adapters train what the framework would train, once, and resume exactly.

Each framework (Hugging Face ``Trainer``, TRL ``SFTTrainer``, Accelerate, Lightning, and a
torchtitan-style loop over ``TitanLoader``) trains a tiny random-weight Llama on 2 Gloo ranks
for 2 epochs of 4 optimizer steps, each step 2 accumulated microbatches, with plain SGD:

* **math unchanged**: the parameters with balancing on equal those with
  ``LoaderConfig(balance=False)`` within 1e-5 relative (of the update), and the plan moved
  samples on some step (asserted);
* **every sample once**: in each epoch the ranks together train exactly the samples the source
  deals (the documented remainder aside), none twice and none on two ranks (no framework
  re-sharded the loader);
* **the loss divisor**: every step's ``num_items_in_batch`` is the world's loss targets of the
  step, counted from the labels every rank trained on, and ``loader.last_loss_tokens.world``;
* **exact resume**: the balanced run checkpoints with the framework's own mechanism after 5
  steps (inside the second epoch) and goes on; resumed from that checkpoint in fresh
  processes, steps 6-8 train the same samples with the same losses and end with the same
  parameters as the run that went on, bitwise.

One pool of two processes serves the module (importing the frameworks dominates its cost); the
resumes run in one fresh pool.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "transformers",
    reason="transformers is not installed; install the test extra (pip install '.[test]')",
)

from testkit import frameworks as fw
from testkit import hf_ranks, other_ranks

from evenflow.transports.launch import RankPool

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
EPOCHS = 2
SAVE_AT = 5  # a checkpoint inside epoch 1 (4 steps per epoch)
_ENV = {"OMP_NUM_THREADS": "1"}


def _plan(balance: bool, save_at: int, resume: bool) -> dict[str, Any]:
    return {"balance": balance, "epochs": EPOCHS, "save_at": save_at, "resume": resume}


def _hf(kind: str) -> Callable[..., Any]:
    def run(pool: RankPool, out: str, balance: bool, save_at: int, resume: bool) -> Any:
        return pool.run(hf_ranks.train, kind, out, _plan(balance, save_at, resume))

    return run


def _other(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(pool: RankPool, out: str, balance: bool, save_at: int, resume: bool) -> Any:
        return pool.run(fn, out, _plan(balance, save_at, resume))

    return run


# name -> (the package it needs, how to run it)
FRAMEWORKS: dict[str, tuple[str, Callable[..., Any]]] = {
    "trainer": ("accelerate", _hf("trainer")),
    "sft": ("trl", _hf("sft")),
    "accelerate": ("accelerate", _other(other_ranks.accelerate_train)),
    "lightning": ("lightning", _other(other_ranks.lightning_train)),
    "titan": ("torch", _other(other_ranks.titan_train)),
}


def _available(name: str) -> bool:
    return importlib.util.find_spec(FRAMEWORKS[name][0]) is not None


def _need(name: str) -> None:
    if not _available(name):
        pytest.skip(f"{FRAMEWORKS[name][0]} is not installed (pip install '.[test]')")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=30.0, deadline=240.0, env=_ENV) as ranks:
        yield ranks


class Runs:
    """Each framework's runs, made once per module on first use."""

    def __init__(self, pool: RankPool, root: Path) -> None:
        self._pool, self._root = pool, root
        self._cache: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def folder(self, name: str) -> str:
        path = self._root / name
        path.mkdir(exist_ok=True)
        return str(path)

    def get(self, name: str, variant: str) -> list[dict[str, Any]]:
        key = (name, variant)
        if key not in self._cache:
            run = FRAMEWORKS[name][1]
            balance = variant == "on"
            stop = SAVE_AT if balance else 0  # the balanced run also checkpoints
            self._cache[key] = run(self._pool, self.folder(name), balance, stop, False)
        return self._cache[key]


@pytest.fixture(scope="module")
def runs(pool: RankPool, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(pool, tmp_path_factory.mktemp("frameworks"))


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_math_unchanged_by_balancing(name: str, runs: Runs) -> None:
    _need(name)
    on, off = runs.get(name, "on"), runs.get(name, "off")
    moved = on[0]["moved"]
    assert len(moved) == 2 * 4 and any(moved), moved  # the plan moved samples
    assert not any(off[0]["moved"])
    for rank in (0, 1):
        # The same samples trained per step, in other places.
        for a, b in zip(on[rank]["steps"], off[rank]["steps"], strict=True):
            assert a["num_items"] == b["num_items"]
        diff = fw.relative_difference(on[rank]["params"], off[rank]["params"], on[rank]["start"])
        assert diff <= TOLERANCE, f"{name}: balanced update differs by {diff:.3g}"
    assert on[0]["params"] == on[1]["params"]  # DDP kept the ranks in sync


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_every_sample_once_per_epoch_on_one_rank(name: str, runs: Runs) -> None:
    _need(name)
    from evenflow.engine import DatasetSource

    on = runs.get(name, "on")
    data = fw.dataset()
    source = DatasetSource(data, seq_len=fw.SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=2, seed=3)
    orders = []
    for epoch in range(EPOCHS):
        source.set_epoch(epoch)
        dealt = sorted(
            int(i)
            for rank in (0, 1)
            for step in range(len(source))
            for b in source.step_indices(step, rank=rank)
            for i in b
        )
        assert len(dealt) == fw.NUM_SAMPLES - source.report.num_dropped_samples
        trained: list[int] = []
        for rank in (0, 1):
            steps = [s for s in on[rank]["steps"] if s["epoch"] == epoch]
            assert len(steps) == len(source), (name, epoch, rank)
            mine = [i for s in steps for mb in s["samples"] for i in mb]
            trained += mine
        assert len(trained) == len(set(trained)), f"{name}: a sample trained twice in {epoch}"
        assert sorted(trained) == dealt, f"{name}: epoch {epoch} missed or added samples"
        orders.append(
            [i for s in on[0]["steps"] if s["epoch"] == epoch for mb in s["samples"] for i in mb]
        )
    assert orders[0] != orders[1]  # each epoch is its own pass (reshuffled)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_loss_divisor_is_the_worlds_loss_tokens(name: str, runs: Runs) -> None:
    _need(name)
    on = runs.get(name, "on")
    for rank in (0, 1):
        for step in on[rank]["steps"]:
            assert step["num_items"] == step["labels_world"] == step["loss_world"], step
    # Balancing changes how many each rank holds, never the world's count.
    mine = [sum(len(mb) for mb in s["samples"]) for s in on[0]["steps"]]
    assert mine != [sum(len(mb) for mb in s["samples"]) for s in runs.get(name, "off")[0]["steps"]]


def test_balance_stats_reach_the_trainer_logs(runs: Runs) -> None:
    _need("trainer")
    on = runs.get("trainer", "on")
    logs = [log for log in on[0]["logs"] if "loss" in log]
    assert len(logs) == 2 * 4  # logging_steps=1
    for log in logs:
        assert log["evenflow/steps"] == 1
        assert log["evenflow/max_cost_after"] <= log["evenflow/max_cost_before"]
    assert sum(log["evenflow/moved_samples"] for log in logs) == sum(on[0]["moved"])


def test_accelerate_prepare_leaves_the_loader_alone(runs: Runs) -> None:
    _need("accelerate")
    assert all(rank["prepared_is_same"] for rank in runs.get("accelerate", "on"))


def test_titan_loader_is_a_torchtitan_dataloader(runs: Runs) -> None:
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip(
            "torchtitan is not installed: its 0.3.0 pins datasets<4.8 (the test extra has "
            "datasets>=4 and this machine 5.2) and pulls ~30 packages, so it is not in the test "
            "extra; TitanLoader is tested against the protocol (test_integrations_common.py)"
        )
    assert all(rank["is_base_dataloader"] for rank in runs.get("titan", "on"))


def test_exact_resume_in_fresh_processes(runs: Runs) -> None:
    names = [name for name in FRAMEWORKS if _available(name)]
    references = {name: runs.get(name, "on") for name in names}  # each wrote a checkpoint
    with RankPool(2, timeout=30.0, deadline=240.0, env=_ENV) as fresh:
        for name in names:
            reference = references[name]
            resumed = FRAMEWORKS[name][1](fresh, runs.folder(name), True, 0, True)
            for rank in (0, 1):
                ref, got = reference[rank], resumed[rank]
                assert got["steps"] == ref["steps"][SAVE_AT:], f"{name}: other samples"
                assert got["losses"] == ref["losses"][SAVE_AT:], f"{name}: other losses"
                assert got["params"] == ref["params"], f"{name}: other parameters"
