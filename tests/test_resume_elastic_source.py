"""DatasetSource restored onto a different number of ranks: the rest of the epoch is dealt to
the new ranks, every unconsumed sample exactly once, none consumed again (one process)."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from evenflow.engine import DatasetSource
from evenflow.engine.errors import ResumeError

SEQ_LEN = 64


def _rows(n: int = 300) -> list[dict[str, object]]:
    lengths = np.random.default_rng(5).integers(1, 48, size=n).tolist()
    return [{"id": i, "input_ids": [0] * int(k)} for i, k in enumerate(lengths)]


def _source(rank: int, num_ranks: int) -> DatasetSource:
    return DatasetSource(
        _rows(), seq_len=SEQ_LEN, bins_per_rank=2, rank=rank, num_ranks=num_ranks, seed=3
    )


def _ids(step: list[list[dict[str, object]]]) -> list[int]:
    return [int(s["id"]) for b in step for s in b]  # type: ignore[call-overload]


def _run(num_ranks: int, epoch: int, stop: int | None) -> tuple[list[int], object]:
    """Every rank's samples of ``stop`` steps (all steps when None) and the state after."""
    seen: list[int] = []
    state = None
    for rank in range(num_ranks):
        source = _source(rank, num_ranks)
        source.set_epoch(epoch)
        for step in itertools.islice(source, stop):
            seen += _ids(step)
        state = source.state_dict()
    return seen, state


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 4), (4, 3), (3, 3), (1, 5)])
@pytest.mark.parametrize("stop", [0, 1, 5])
def test_the_rest_of_the_epoch_is_dealt_to_the_new_ranks_exactly_once(
    old: int, new: int, stop: int
) -> None:
    before, state = _run(old, epoch=1, stop=stop)
    after: list[int] = []
    lengths = []
    for rank in range(new):
        source = _source(rank, new)
        source.load_state_dict(state)  # type: ignore[arg-type]
        steps = list(source)
        lengths.append(len(steps))
        after += [i for step in steps for i in _ids(step)]
    assert len(set(lengths)) == 1  # every new rank has the same number of steps
    delivered = collections.Counter(before + after)
    assert max(delivered.values()) == 1  # nothing twice
    # What is left unread is the packer's remainder plus fewer than `new` whole units.
    report = _source(0, new)
    report.load_state_dict(state)  # type: ignore[arg-type]
    total = len(_rows())
    assert len(delivered) == total - report.report.num_dropped_samples
    # The unread units after the restore are fewer than `new` (each holds at least one sample
    # per bin), on top of the packer's remainder, which an uninterrupted epoch leaves too.
    uninterrupted = _source(0, 1).report.num_dropped_samples  # the packer's remainder only
    assert report.report.num_dropped_samples - uninterrupted < new * 2 * SEQ_LEN
    if old == new:  # the same ranks: bitwise the uninterrupted epoch
        everything, _ = _run(old, epoch=1, stop=None)
        assert sorted(before + after) == sorted(everything)


def test_the_next_epoch_is_dealt_to_the_new_ranks_from_its_start() -> None:
    _, state = _run(4, epoch=0, stop=3)
    source = _source(1, 2)
    source.load_state_dict(state)  # type: ignore[arg-type]
    assert source.step == 3
    source.set_epoch(1)
    fresh = _source(1, 2)
    fresh.set_epoch(1)
    assert [_ids(s) for s in source] == [_ids(s) for s in fresh]


def test_a_state_is_the_same_on_every_rank_at_the_same_step() -> None:
    states = []
    for rank in range(3):
        source = _source(rank, 3)
        for _ in itertools.islice(source, 2):
            pass
        states.append(source.state_dict())
    assert states[0] == states[1] == states[2]


def test_a_step_before_the_restored_position_is_refused() -> None:
    _, state = _run(4, epoch=0, stop=3)
    source = _source(0, 2)
    source.load_state_dict(state)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="before the position"):
        source.step_indices(1)
    with pytest.raises(ResumeError, match="beyond"):
        source.load_state_dict({**state, "step": 10_000})  # type: ignore[dict-item]


def test_a_state_saved_inside_a_balance_window_restores_only_onto_the_same_ranks() -> None:
    from evenflow.engine._pipeline.resume import loader_state, read_state

    def saved(step: int, read_from: int) -> dict[str, object]:
        _, source_state = _run(4, epoch=0, stop=read_from)
        return loader_state(
            epoch=0,
            step=step,
            identity={"config": {}},
            source=_source(0, 4),
            source_state=source_state,
            process_rank=0,
            group_rank=0,
            group=[0, 1, 2, 3],
            read_from=read_from,
        )

    def restore(step: int, num_ranks: int, read_from: int | None = None) -> object:
        return read_state(
            saved(step, step - step % 4 if read_from is None else read_from),
            identity={"config": {}},
            source=_source(0, num_ranks),
            process_rank=0,
            group_rank=0,
            group=list(range(num_ranks)),
            max_steps=None,
            window=4,
        )

    with pytest.raises(ResumeError, match=r"inside a balance window of 4 steps .* on 4 ranks"):
        restore(5, 2)
    assert restore(5, 4).step == 5  # the same ranks finish the window
    assert restore(4, 2).step == 4  # a window boundary: any number of ranks
    assert restore(5, 2, read_from=5).step == 5  # a window the pass closed early: too
    with pytest.raises(ResumeError, match=r"allows steps 2 to 5; .* another balance_window"):
        restore(5, 4, read_from=1)  # not a step of the window that holds step 5
