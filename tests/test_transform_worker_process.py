"""The worker process's own loop: what it does with a result the training process can no
longer receive."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from evenflow.engine._sources import workers


class _Arrays:
    """A dataset of samples large enough to come back through a shared-memory segment."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"array": np.full(workers.SHM_MIN_BYTES, index, dtype=np.int64)}


def _segments(pid: int) -> set[str]:
    prefix = f"evenflow-{pid}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def test_a_result_the_training_process_cannot_receive_leaves_no_segment() -> None:
    # The training process sends work and is gone before the reply: its end of the pipe is
    # closed, so the worker's send fails after it wrote the result's segment.
    context = workers.start_context()
    parent_end, child_end = context.Pipe(duplex=True)
    worker = context.Process(
        target=workers.worker_main,
        args=(child_end, _Arrays(), None, 0, os.getpid()),
        daemon=True,
    )
    worker.start()
    child_end.close()
    parent_end.send((0, 1, [0, 1]))  # task 0, epoch 1: read dataset indices 0 and 1
    parent_end.close()
    worker.join(timeout=60)
    assert worker.exitcode == 0, "the worker did not return after its pipe closed"
    assert not _segments(worker.pid), "the unsent result's shared-memory segment leaked"


def test_a_sent_result_maps_in_place_and_unlinks_its_segment() -> None:
    before = _segments(os.getpid())
    samples = [{"array": np.arange(workers.SHM_MIN_BYTES, dtype=np.int64) + i} for i in range(2)]
    packed = workers._pack(samples)
    assert packed[0] == "shm" and _segments(os.getpid()) - before  # written to a segment
    got = workers.unpack(packed)
    assert _segments(os.getpid()) == before  # unlinked as soon as it is mapped
    for sample, back in zip(samples, got, strict=True):
        assert np.array_equal(sample["array"], back["array"])
