"""``LoaderConfig.device_prefetch_depth``: how many prepared steps may sit on the device.

The device code path runs on CPU against a recording stand-in for ``torch.cuda`` (streams,
events, a current device); tensors are "pinned" by a recording stand-in too, because a CPU
build cannot pin. The loader is real: its pack stage stages a step at once while a device
slot is free and otherwise pins it and leaves it on the host; its h2d stage copies it when
the caller has taken an earlier step.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from testkit.devices import FakeDevice

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine._pipeline import h2d
from evenflow.engine.errors import ConfigError

STEPS = 7
PREFETCH = 3


def _steps() -> list[list[list[list[int]]]]:
    # Every token of step s is s, so a packed batch names its step.
    return [[[[s] * 5, [s] * 3], [[s] * 4]] for s in range(STEPS)]


def _batch_step(batch: Any) -> int:
    return int(batch[0]["input_ids"][0, 0])


def _run(
    monkeypatch: pytest.MonkeyPatch, device_depth: int | None
) -> tuple[list[Any], set[int], set[int]]:
    """Iterate every step; return the event log and the steps staged and pinned once every
    prepared step is packed, before the second ``next()``."""
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    prepared = threading.Condition(lock)
    monkeypatch.setattr(h2d, "_load_device_module", lambda device: FakeDevice())
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    original_pin = h2d.DeviceStager.pin

    def pin(self: h2d.DeviceStager, batch: Any) -> Any:
        with prepared:
            log.append(("pin", _batch_step(batch)))
            prepared.notify_all()
        return original_pin(self, batch)

    def move(batch: Any, device: torch.device) -> Any:
        with prepared:
            log.append(("stage", _batch_step(batch)))
            prepared.notify_all()
        return batch  # stays in host memory: the stand-in device is the host

    monkeypatch.setattr(h2d.DeviceStager, "pin", pin)
    config = LoaderConfig(
        seq_len=16,
        bins_per_rank=2,
        prefetch_depth=PREFETCH,
        device_prefetch_depth=device_depth,
        log_stats=False,
    )
    with BalancedLoader(_steps(), config=config, device="cuda:0", move_fn=move) as loader:
        it = iter(loader)
        loader.prefetch()  # a no-op here: starting the pass takes the first next()
        with prepared:
            log.append(("next", 0))
        first = next(it)
        assert _batch_step(first) == 0
        # Wait until steps 1 .. prefetch_depth + 1 (every undelivered step the pipeline may
        # prepare) are packed and as many as the bound allows are staged.
        bound = PREFETCH + 1 if device_depth is None else device_depth

        def steps(kind: str) -> set[int]:
            return {s for k, s in log if k == kind}

        with prepared:
            assert prepared.wait_for(
                lambda: (
                    steps("stage") | steps("pin") >= set(range(PREFETCH + 2))
                    and len(steps("stage")) >= 1 + bound
                ),
                timeout=20.0,
            ), log
            staged, pinned = steps("stage"), steps("pin")
        for k in range(1, STEPS):
            with prepared:
                log.append(("next", k))
            assert _batch_step(next(it)) == k
        with pytest.raises(StopIteration):
            next(it)
    return log, staged, pinned


@pytest.mark.parametrize("device_depth", [1, 2, None])
def test_device_prefetch_depth_bounds_the_steps_on_the_device(
    monkeypatch: pytest.MonkeyPatch, device_depth: int | None
) -> None:
    bound = PREFETCH + 1 if device_depth is None else device_depth
    log, staged, pinned = _run(monkeypatch, device_depth)
    # After step 0 was delivered: steps 1 .. PREFETCH + 1 are prepared; `bound` of them are
    # on the device (step 0, held by the caller, is too) and the others wait pinned.
    assert staged == set(range(1 + bound)), log
    assert pinned >= set(range(1 + bound, PREFETCH + 2)), log
    assert [s for kind, s in log if kind == "stage"] == list(range(STEPS))  # in step order
    taken = 0
    for kind, step in log:
        if kind == "next":
            taken += 1
        elif kind == "stage":
            # Steps the caller has asked for are off the bound; the others are at most it.
            assert step - taken < bound, (step, taken, log)
    # A step that waited on the host was pinned there, before its copy.
    for kind, step in log:
        if kind == "pin":
            assert log.index(("pin", step)) < log.index(("stage", step))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"prefetch_depth": 2, "device_prefetch_depth": 3}, "at most prefetch_depth=2"),
        ({"device_prefetch_depth": 0}, r"device_prefetch_depth must be an integer >= 1"),
        ({"device_prefetch_depth": True}, r"device_prefetch_depth must be an integer"),
    ],
)
def test_device_prefetch_depth_is_validated(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LoaderConfig(seq_len=16, bins_per_rank=2, **settings)


def test_device_prefetch_depth_may_change_on_resume() -> None:
    config = LoaderConfig(seq_len=16, bins_per_rank=2, log_stats=False)
    with BalancedLoader(_steps(), config=config) as loader:
        next(iter(loader))
        state = loader.state_dict()
    bounded = LoaderConfig(seq_len=16, bins_per_rank=2, device_prefetch_depth=1, log_stats=False)
    with BalancedLoader(_steps(), config=bounded) as loader:
        loader.load_state_dict(state)
        assert _batch_step(next(iter(loader))) == 1
