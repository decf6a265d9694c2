"""What every framework adapter shares, in one process: microbatches, epochs, restores, states,
and torchtitan's dataloader protocol (``TitanLoader``), without any framework installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig, default_pack_fn
from evenflow.engine.errors import ConfigError, ResumeError
from evenflow.engine.integrations import LoaderView, merge_packed
from evenflow.engine.integrations._common import merge_states
from evenflow.engine.integrations.torchtitan import TitanLoader, titan_microbatch

SEQ_LEN = 32


def _samples(n: int = 60) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        size = int(torch.randint(3, 14 if i % 5 else 28, (1,), generator=gen))
        ids = torch.randint(0, 100, (size,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (size // 3) + ids[size // 3 :]})
    return out


def _loader(bins: int = 4, **config: Any) -> BalancedLoader:
    source = DatasetSource(_samples(), seq_len=SEQ_LEN, bins_per_rank=bins, seed=1)
    return BalancedLoader(
        source, config=LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=bins, log_stats=False, **config)
    )


def _ids(items: list[Any]) -> list[list[int]]:
    return [item["input_ids"][0].tolist() for item in items]


def test_merge_packed_is_one_bin_of_all_the_samples() -> None:
    samples = _samples(7)
    merged = merge_packed([default_pack_fn(samples[:3], 64), default_pack_fn(samples[3:], 64)])
    whole = default_pack_fn(samples, 200)
    assert merged.keys() == whole.keys()
    for key, value in whole.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(merged[key], value), key
            assert merged[key].dtype == value.dtype, key
        else:
            assert merged[key] == value, key
    assert merge_packed([whole]) == whole
    with pytest.raises(KeyError, match="Packed bin 0 has no 'labels'"):
        merge_packed([{"input_ids": torch.zeros(1, 2)}, {"input_ids": torch.zeros(1, 2)}])


def test_a_step_is_cut_into_microbatches() -> None:
    with _loader() as loader:
        view = LoaderView(
            loader, bins_per_microbatch=2, extra={"use_cache": False}, with_num_items=True
        )
        assert view.microbatches_per_step == 2
        assert len(view) == 2 * len(loader)
        items = list(view)
        assert len(items) == len(view)
        for item in items:
            assert item["use_cache"] is False
            assert item["num_items_in_batch"] > 0
            # two bins in one row: their sample boundaries are all there
            assert int(item["cu_seq_lens_q"][-1]) == item["input_ids"].shape[1]
    with _loader() as loader, pytest.raises(ConfigError, match="not a multiple"):
        LoaderView(loader, bins_per_microbatch=3)


def test_iterating_again_starts_the_next_epoch() -> None:
    with _loader() as loader:
        view = LoaderView(loader)
        first, second = _ids(list(view)), _ids(list(view))
        assert view.epoch == 1 and loader.epoch == 1
    with _loader() as loader:
        view = LoaderView(loader)
        view.set_epoch(1)
        assert _ids(list(view)) == second
    assert first and second and first != second


def _reference(epoch: int) -> list[list[int]]:
    with _loader() as loader:
        view = LoaderView(loader)
        view.set_epoch(epoch)
        return _ids(list(view))


def _saved(epoch: int, microbatches: int) -> dict[str, Any]:
    with _loader() as loader:
        view = LoaderView(loader, bins_per_microbatch=2)
        view.set_epoch(epoch)
        it = iter(view)
        for _ in range(microbatches):
            next(it)
        return view.state_dict()


@pytest.mark.parametrize("order", ["restore-first", "epoch-first", "iter-first", "no-epoch"])
def test_a_restore_does_not_depend_on_the_order_of_calls(order: str) -> None:
    reference = _reference(1)  # one bin per microbatch: 4 per step
    state = _saved(1, 4)  # two steps of two microbatches each
    assert state["epoch"] == 1 and state["step"] == 2
    with _loader() as loader:
        view = LoaderView(loader)
        if order == "restore-first":
            view.load_state_dict(state)
            view.set_epoch(1)
            it = iter(view)
        elif order == "epoch-first":
            view.set_epoch(1)
            view.load_state_dict(state)
            it = iter(view)
        elif order == "iter-first":  # Lightning: the iterator exists before set_epoch
            view.load_state_dict(state)
            it = iter(view)
            view.set_epoch(1)
        else:
            view.load_state_dict(state)
            assert view.start_epoch == 1
            it = iter(view)
        assert _ids(list(it)) == reference[8:]


def test_a_checkpoint_taken_while_the_next_step_is_prefetched_is_at_the_step_boundary() -> None:
    at_boundary = _saved(0, 4)
    prefetched = _saved(0, 5)  # the first microbatch of step 2 was taken, not trained
    assert prefetched == at_boundary and prefetched["step"] == 2
    assert _saved(0, 6)["step"] == 3


def test_a_finished_epochs_state_starts_the_next_epoch() -> None:
    with _loader() as loader:
        steps = len(loader)
    end = _saved(0, 2 * steps)
    assert end["step"] == steps
    with _loader() as loader:
        view = LoaderView(loader)
        view.load_state_dict(end)
        view.set_epoch(1)
        assert _ids(list(view)) == _reference(1)
    with _loader() as loader:
        view = LoaderView(loader)
        view.load_state_dict(_saved(0, 2))
        view.set_epoch(1)
        with pytest.raises(ResumeError, match="steps before its end"):
            next(iter(view))


def test_merged_states_unite_the_ranks_and_refuse_different_steps() -> None:
    a = {"epoch": 0, "step": 3, "ranks": {"0": {"x": 1}}}
    b = {"epoch": 0, "step": 3, "ranks": {"1": {"x": 2}}}
    assert merge_states([a, b]) == {"epoch": 0, "step": 3, "ranks": {"0": {"x": 1}, "1": {"x": 2}}}
    with pytest.raises(ResumeError, match="differs from rank 0's in 'step'"):
        merge_states([a, {**b, "step": 4}])


def test_titan_microbatch_shifts_the_labels() -> None:
    packed = default_pack_fn(_samples(3), 64)
    inputs, labels = titan_microbatch(packed)
    assert torch.equal(inputs["input"], packed["input_ids"])
    assert torch.equal(inputs["positions"], packed["position_ids"])
    assert torch.equal(labels[:, :-1], packed["labels"][:, 1:])
    assert int(labels[0, -1]) == -100
    # the loss targets are the packed bin's (its first label is -100)
    assert int((labels != -100).sum()) == int((packed["labels"] != -100).sum())


def test_titan_loader_speaks_torchtitans_protocol() -> None:
    from torch.distributed.checkpoint.stateful import Stateful

    with _loader(bins=2) as loader:
        steps = len(loader)
        titan = TitanLoader(loader, dp_rank=0, dp_world_size=1)
        assert isinstance(titan, Stateful)
        it = iter(titan)
        # infinite: the next epoch follows the last (torchtitan trains by steps)
        pairs = [next(it) for _ in range(2 * steps + 2)]
        assert titan.view.epoch == 1
        for inputs, labels in pairs:
            assert set(inputs) == {"input", "positions"}
            assert labels.shape == inputs["input"].shape
        state = titan.state_dict()
        after = next(it)
    assert set(state) == {"dp_rank_0", "world_size"} and state["world_size"] == 1
    assert state["dp_rank_0"]["epoch"] == 1 and state["dp_rank_0"]["step"] == 1
    with _loader(bins=2) as loader:
        titan = TitanLoader(loader, dp_rank=0, dp_world_size=1)
        titan.load_state_dict({})  # torchtitan's fresh start
        titan.load_state_dict(state)
        resumed = next(iter(titan))
    assert torch.equal(resumed[0]["input"], after[0]["input"])
    assert torch.equal(resumed[1], after[1])
    with _loader(bins=2) as loader:
        titan = TitanLoader(loader, dp_rank=1, dp_world_size=2)
        with pytest.raises(ResumeError, match="no entry for 'dp_rank_1'"):
            titan.load_state_dict(state)
        with pytest.raises(ResumeError, match="world_size=1"):
            titan.load_state_dict({"dp_rank_1": state["dp_rank_0"], "world_size": 1})


def test_an_epoch_left_unread_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with _loader() as loader:
        view = LoaderView(loader, bins_per_microbatch=2)
        steps = len(loader)
        it = iter(view)
        for _ in range(2 * steps):  # the whole epoch: no warning at the next one
            next(it)
        view.set_epoch(1)
        it = iter(view)
        next(it)  # one microbatch of epoch 1, then the framework moves on
        assert "unread" not in caplog.text
        view.set_epoch(2)
        next(iter(view))
    assert f"epoch 1 still had {steps - 1} of its {steps} steps unread" in caplog.text
