"""Loss-token accounting: per-sample counts in the metadata, and every delivered step's totals
on its rank, its balance group and the whole data-parallel world (the world round across
groups, with its shared ends and failures).

Ranks run as threads over in-process transports: two balance groups of two ranks, and a world
transport over all four.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from testkit.loaders import DEADLINE, run_in_threads, run_in_threads_or_raise

from evenflow.engine import (
    BalancedLoader,
    DatasetSource,
    IndexedSample,
    LoaderConfig,
    LossTokens,
    SampleMetadata,
    count_loss_tokens,
)
from evenflow.engine._pipeline import plan_stage
from evenflow.engine._pipeline.pack import with_loss_tokens
from evenflow.engine.errors import ConfigError, RemoteStageError, SourceExhaustedError
from evenflow.transports import InProcessGroup

SEQ_LEN = 64
BINS = 2


def _sample(rank: int, step: int, i: int, length: int) -> dict[str, Any]:
    """Token ids that name the sample; every third one masks a prompt of a third of it."""
    tokens = np.full(length, rank * 1000 + step * 10 + i, dtype=np.int64)
    if i % 3:
        return {"input_ids": tokens}
    labels = tokens.copy()
    labels[: length // 3] = -100
    return {"input_ids": tokens, "labels": labels}


def _lengths(rank: int, step: int) -> list[list[int]]:
    # Group rank 0 of each group reads long samples, rank 1 short ones: balancing moves some.
    if rank % 2 == 0:
        return [[24 + step, 20], [22, 18 + step]]
    return [[5, 6, 4 + step], [7, 3, 5, 6]]


class _Source:
    def __init__(self, rank: int, num_steps: int, fail_at: int | None = None) -> None:
        self.rank, self.num_steps, self.fail_at = rank, num_steps, fail_at

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Any:
        for step in range(self.num_steps):
            if step == self.fail_at:
                raise ValueError(f"source broke on rank {self.rank}")
            i = 0
            bins = []
            for sizes in _lengths(self.rank, step):
                bins.append([_sample(self.rank, step, (i := i + 1), n) for n in sizes])
            yield bins


def _world_of_groups(
    steps: list[int], *, fail_at: dict[int, int] | None = None, **cfg: Any
) -> list[BalancedLoader]:
    """Four loaders: groups (0, 1) and (2, 3), and a world transport over all four."""
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=BINS, log_stats=False, **cfg)
    groups = [InProcessGroup(2, timeout=DEADLINE), InProcessGroup(2, timeout=DEADLINE)]
    world = InProcessGroup(4, timeout=DEADLINE)
    fails = fail_at or {}
    return [
        BalancedLoader(
            _Source(r, steps[r], fails.get(r)),
            config=config,
            transport=groups[r // 2].transport(r % 2),
            world_transport=world.transport(r),
            cost_model="quadratic",
        )
        for r in range(4)
    ]


def _record(rank: int, loader: BalancedLoader) -> list[dict[str, Any]]:
    out = []
    for batch in loader:
        tokens = loader.last_loss_tokens
        stats = loader.last_stats
        assert tokens is not None and stats is not None
        out.append(
            {
                "tokens": tokens,
                "counted": sum(count_loss_tokens(packed) for packed in batch),
                "moved": stats.num_moved,
            }
        )
    return out


# -- metadata -----------------------------------------------------------------------------------


def test_metadata_carries_loss_tokens_and_checks_them() -> None:
    meta = SampleMetadata(tokens=8, loss_tokens=5)
    assert SampleMetadata.from_wire(meta.to_wire()) == meta
    assert SampleMetadata.from_wire((8, {}, {})).loss_tokens is None
    with pytest.raises(ConfigError, match="loss_tokens must be at most tokens=8"):
        SampleMetadata(tokens=8, loss_tokens=9)
    with pytest.raises(ConfigError, match="loss_tokens must be an integer >= 0"):
        SampleMetadata(tokens=8, loss_tokens=-1)


def test_the_default_pack_counts_what_it_trains_on() -> None:
    describe = with_loss_tokens(lambda s: len(s["input_ids"]) if isinstance(s, dict) else len(s))
    masked = {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}
    assert describe([7, 8, 9]).loss_tokens == 2 == count_loss_tokens([7, 8, 9])
    assert describe(masked).loss_tokens == 2 == count_loss_tokens(masked)
    assert describe({"input_ids": [5]}).loss_tokens == 0
    # A count the metadata function gives is kept; what is not metadata passes through.
    given = with_loss_tokens(lambda s: SampleMetadata(tokens=3, loss_tokens=1))
    assert given([1, 2, 3]).loss_tokens == 1
    assert with_loss_tokens(lambda s: "bad")([1]) == "bad"
    # A dataset index stands for a sample whose labels are not read yet: unknown.
    assert with_loss_tokens(lambda s: s.tokens)(IndexedSample(3, 9)).loss_tokens is None


def test_loss_scale_is_the_divide_factor_over_the_world() -> None:
    tokens = LossTokens(step=0, rank=30, group=70, world=140)
    assert tokens.loss_scale(4) == pytest.approx(4 / 140)
    assert LossTokens(step=0, rank=0, group=0, world=0).loss_scale(2) == 0.0
    with pytest.raises(ConfigError, match="divide_factor"):
        tokens.loss_scale(0)


def test_a_custom_pack_without_counts_has_no_loss_tokens() -> None:
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=BINS, log_stats=False)
    with BalancedLoader(_Source(0, 1), config=config, pack_fn=lambda s, n: len(s)) as loader:
        next(iter(loader))
        assert loader.last_loss_tokens is None


def test_world_transport_is_checked() -> None:
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=BINS, log_stats=False)
    group = InProcessGroup(1, timeout=DEADLINE)
    transport = group.transport(0)
    with pytest.raises(TypeError, match="world_transport must be a Transport"):
        BalancedLoader([], config=config, transport=transport, world_transport="gloo")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must not be the balance group's transport"):
        BalancedLoader([], config=config, transport=transport, world_transport=transport)


# -- totals ---------------------------------------------------------------------------------


def test_one_group_is_the_world() -> None:
    group = InProcessGroup(2, timeout=DEADLINE)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=BINS, log_stats=False)
    loaders = [
        BalancedLoader(_Source(r, 3), config=config, transport=group.transport(r)) for r in range(2)
    ]
    results = run_in_threads_or_raise(loaders, _record)
    for step in range(3):
        a, b = (results[r][step] for r in range(2))
        assert a["tokens"].rank == a["counted"] and b["tokens"].rank == b["counted"]
        assert a["tokens"].group == a["tokens"].world == a["counted"] + b["counted"]
        assert b["tokens"].group == a["tokens"].group


@pytest.mark.parametrize("window", [1, 3])
def test_every_step_totals_its_rank_group_and_world(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if window > 1:
        # Every sample trains in another step of its window than the one that read it.
        from testkit.windows import rotating_plan_window

        monkeypatch.setattr(plan_stage, "plan_window", rotating_plan_window)
    loaders = _world_of_groups([4, 4, 4, 4], balance_window=window)
    results = run_in_threads_or_raise(loaders, _record)
    assert [len(r) for r in results] == [4, 4, 4, 4]
    assert sum(r[0]["moved"] for r in results) > 0  # balancing changed rank totals
    for step in range(4):
        rows = [results[r][step] for r in range(4)]
        counted = [row["counted"] for row in rows]
        for r, row in enumerate(rows):
            tokens = row["tokens"]
            assert tokens.step == step and tokens.rank == counted[r]
            group = r // 2
            assert tokens.group == counted[2 * group] + counted[2 * group + 1]
            assert tokens.world == sum(counted)


def test_a_group_that_ends_first_ends_the_pass_everywhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loaders = _world_of_groups([2, 2, 5, 5])
    with caplog.at_level(logging.WARNING, logger="evenflow"):
        results = run_in_threads_or_raise(loaders, _record)
    assert [len(r) for r in results] == [2, 2, 2, 2]
    for loader in loaders:
        summary = loader.last_pass
        assert summary is not None and summary.end_reason == "uneven"
        assert summary.uneven is not None and summary.uneven.step == 2
        assert summary.uneven.ended_ranks == (0, 1)  # world ranks
        assert {u.rank for u in summary.uneven.unread} == {2, 3}
    assert any("ended at step 2" in r.getMessage() for r in caplog.records)


def test_a_group_that_ends_first_raises_everywhere_under_raise() -> None:
    loaders = _world_of_groups([2, 2, 5, 5], on_uneven_end="raise")
    _, errors, hung = run_in_threads(loaders, _record)
    assert not any(hung)
    assert all(isinstance(e, SourceExhaustedError) for e in errors), errors


def test_a_failure_in_one_group_stops_every_group_at_that_step() -> None:
    loaders = _world_of_groups([5, 5, 5, 5], fail_at={3: 2})
    delivered: list[list[int]] = [[] for _ in range(4)]

    def body(rank: int, loader: BalancedLoader) -> None:
        for _ in loader:
            delivered[rank].append(loader.step)

    _, errors, hung = run_in_threads(loaders, body)
    assert not any(hung)
    assert delivered == [[1, 2]] * 4
    assert isinstance(errors[3], ValueError)
    for rank in (0, 1):  # the other group learns it in the world round
        assert isinstance(errors[rank], RemoteStageError), errors[rank]
        assert errors[rank].failed_rank == 3 and errors[rank].step == 2
    assert isinstance(errors[2], RemoteStageError)  # its own group's peer


def test_shared_dataset_mode_counts_the_packed_labels() -> None:
    """Shared-dataset mode plans dataset indices and reads the samples afterwards: the counts
    come from the packed labels, and the group's total from the ranks' reports."""
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(5)
    rows: dict[str, list[Any]] = {"input_ids": [], "labels": []}
    for i in range(60):
        n = int(rng.integers(2, 30))
        tokens = [i % 97] * n
        rows["input_ids"].append(tokens)
        rows["labels"].append([-100] * (n // 2) + tokens[n // 2 :])  # a masked prompt
    data = datasets.Dataset.from_dict(rows)
    group = InProcessGroup(2, timeout=DEADLINE)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=BINS, log_stats=False, max_steps=3)
    loaders = []
    for r in range(2):
        source = DatasetSource(
            data, seq_len=SEQ_LEN, bins_per_rank=BINS, rank=r, num_ranks=2, shared=True
        )
        loaders.append(BalancedLoader(source, config=config, transport=group.transport(r)))
    results = run_in_threads_or_raise(loaders, _record)
    for step in range(3):
        a, b = (results[r][step] for r in range(2))
        assert a["tokens"].rank == a["counted"] and b["tokens"].rank == b["counted"]
        assert a["tokens"].group == b["tokens"].world == a["counted"] + b["counted"]
