"""The worker process's own loop, run on a thread of the test: what it does with a result
the training process can no longer receive."""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import numpy as np

from evenflow.engine._sources import workers


class _ClosesTheParentEnd:
    """A dataset whose read closes the training process's end of the pipe: the worker then
    holds a finished result nobody will map (the training process died while it worked)."""

    def __init__(self, parent_end: Any) -> None:
        self.parent_end = parent_end

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.parent_end.close()
        # Large enough that the result goes through a shared-memory segment.
        return {"array": np.full(workers.SHM_MIN_BYTES, index, dtype=np.int64)}


def _segments() -> set[str]:
    prefix = f"evenflow-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def test_a_result_the_training_process_cannot_receive_leaves_no_segment() -> None:
    before = _segments()
    parent_end, child_end = multiprocessing.Pipe(duplex=True)
    parent_end.send((0, 1, [0, 1]))  # task 0, epoch 1: read dataset indices 0 and 1
    worker = threading.Thread(
        target=workers.worker_main,
        args=(child_end, _ClosesTheParentEnd(parent_end), None, 0, os.getpid()),
    )
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the worker loop did not return after its pipe closed"
    assert _segments() == before, "the unsent result's shared-memory segment leaked"
    child_end.close()


def test_a_sent_result_maps_in_place_and_unlinks_its_segment() -> None:
    before = _segments()
    samples = [{"array": np.arange(workers.SHM_MIN_BYTES, dtype=np.int64) + i} for i in range(2)]
    packed = workers._pack(samples)
    assert packed[0] == "shm" and _segments() - before  # written to a segment
    got = workers.unpack(packed)
    assert _segments() == before  # unlinked as soon as it is mapped
    for sample, back in zip(samples, got, strict=True):
        assert np.array_equal(sample["array"], back["array"])
