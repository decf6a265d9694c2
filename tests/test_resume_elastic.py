"""Restores as clusters restart, on real Gloo processes with torch.distributed.checkpoint.

A ``DatasetSource`` loader saved with ``dcp.save({"loader": loader})`` on N ranks and loaded
with ``dcp.load`` on M ranks delivers the rest of the interrupted epoch exactly once (checked
against the source's own dealing, step by step, over all ranks), and the next epoch with the
M-rank sharding; N -> N is bitwise the uninterrupted run; ``max_steps`` may change; a changed
identity field, ranks saved at different steps, and a per-rank source moved to other ranks are
refused on every rank, naming why (onto more ranks, by DCP itself: the new ranks' keys are
missing from the checkpoint).

With a balance window a sample may train in another step of its window, so the oracle is the
dealing window by window: a state saved at a window boundary restores onto any number of ranks,
one saved inside a window is bitwise the uninterrupted run on the same ranks and refused, on
every rank, on others.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, DatasetSource, IterableSource, LoaderConfig
from evenflow.transports.launch import RankPool

pytestmark = pytest.mark.multiprocess

N = 240
SEQ_LEN = 64
#: Where the 4-rank run is saved, and where the 2-rank one is.
CUTS4 = (1, 2, 3, 4)
CUTS2 = (2, 3)


def _rows() -> list[dict[str, Any]]:
    lengths = np.random.default_rng(11).integers(1, 48, size=N)
    return [{"id": i, "input_ids": [i % 251] * int(n)} for i, n in enumerate(lengths)]


def _ids(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    return [int(s["id"]) for s in samples]


def _source(rank: int, num_ranks: int, shared: bool = False) -> DatasetSource:
    return DatasetSource(
        _rows(),
        seq_len=SEQ_LEN,
        bins_per_rank=2,
        rank=rank,
        num_ranks=num_ranks,
        seed=7,
        shared=shared,
    )


class _World:
    """The first ``size`` ranks of the pool: a group for DCP, and a fresh one for each loader
    (two threads must never drive one Gloo group, and a loader closed mid-step may leave
    messages its group's next user would read)."""

    LOADERS = 6  # the most loaders one function builds

    def __init__(self, rank: int, size: int) -> None:
        from evenflow.transports._protocol import new_group

        # Every rank of the pool creates every group, members or not, in the same order.
        self.rank, self.size = rank, size
        self.dcp = new_group(range(size), timeout=10.0, backend="gloo")
        self._data = [
            new_group(range(size), timeout=10.0, backend="gloo") for _ in range(self.LOADERS)
        ]

    def data(self) -> Any:
        return self._data.pop()

    def save(self, state: dict[str, Any], path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=path, process_group=self.dcp)

    def load(self, state: dict[str, Any], path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=path, process_group=self.dcp)


def _within(rank: int, pool_size: int, size: int, name: str, *args: Any) -> Any:
    """Run the function ``name`` of this module, ``fn(world, *args)``, on the first ``size``
    ranks of the pool (arguments travel as msgpack: a function goes by name)."""
    world = _World(rank, size)
    return globals()[name](world, *args) if rank < size else None


def _loader(world: _World, depth: int, kind: str = "dataset", **cfg: Any) -> Any:
    """A loader of this world's ranks; ``cfg``: more ``LoaderConfig`` fields."""
    from evenflow.transports import GlooTransport

    rank, num_ranks = world.rank, world.size

    if kind in ("dataset", "shared"):
        # The loader gives the source its seq_len, bins and ranks (a config with another
        # seq_len then reaches the restore check, which must refuse it).
        source: Any = DatasetSource(_rows(), seed=7, shared=kind == "shared")
    else:
        rows = _rows()[rank::num_ranks]
        source = IterableSource(lambda: iter(rows))
    config = LoaderConfig(
        seq_len=cfg.pop("seq_len", SEQ_LEN),
        bins_per_rank=2,
        prefetch_depth=depth,
        log_stats=False,
        **cfg,
    )
    return BalancedLoader(
        source,
        config=config,
        transport=GlooTransport(world.data(), timeout=10.0),
        metadata_fn=source.metadata_fn,
        pack_fn=_ids,
        collate_fn=list,
        cost_model="quadratic",
    )


# -- what runs on the ranks ----------------------------------------------------------------------


def _record(world: _World, root: str, kind: str, depth: int, cuts: tuple[int, ...]) -> Any:
    """One uninterrupted epoch, saved with DCP after each step in ``cuts``; a per-rank
    (IterableSource) loader saved once too."""
    num_ranks = world.size
    batches = []
    with _loader(world, depth, kind) as loader:
        for batch in loader:
            batches.append(batch)
            if loader.step in cuts:
                world.save({"loader": loader}, f"{root}/dataset-{num_ranks}-{loader.step}")
    with _loader(world, 1, kind="iterable") as loader:
        for _ in itertools.islice(loader, 1):
            world.save({"loader": loader}, f"{root}/iterable-{num_ranks}-1")
    return batches


def _resume(world: _World, root: str, runs: list[tuple[int, int, int, str]]) -> Any:
    """Per (saved ranks, cut, depth, kind): the rest of epoch 0 after ``dcp.load``, then
    epoch 1."""
    out = []
    for saved, cut, depth, kind in runs:
        with _loader(world, depth, kind) as loader:
            world.load({"loader": loader}, f"{root}/dataset-{saved}-{cut}")
            assert loader.step == cut
            rest = list(loader)
            loader.set_epoch(1)
            out.append((rest, list(loader)))
    return out


def _refusals(world: _World, root: str) -> Any:
    """The restores that must fail, each message; and a longer run from a max_steps=3 save."""
    from evenflow.engine.errors import ResumeError

    rank = world.rank
    messages = {}
    attempts = {
        "seq_len": (lambda: _loader(world, 1, seq_len=SEQ_LEN + 8), "dataset-2-2"),
        "iterable": (lambda: _loader(world, 1, kind="iterable"), "iterable-4-1"),
    }
    for name, (make, checkpoint) in attempts.items():
        with make() as loader:
            try:
                world.load({"loader": loader}, f"{root}/{checkpoint}")
            except ResumeError as exc:
                messages[name] = str(exc)
    # Ranks out of step at the save: rank 0 consumed 2 steps, rank 1 three.
    with _loader(world, 2) as loader:
        for _ in itertools.islice(loader, 2 + rank):
            pass
        world.save({"loader": loader}, f"{root}/skewed")
    with _loader(world, 2) as loader:
        try:
            world.load({"loader": loader}, f"{root}/skewed")
        except ResumeError as exc:
            messages["skewed"] = str(exc)
    # A run of max_steps=3, extended to 6 on resume.
    with _loader(world, 2, max_steps=3) as loader:
        assert len(list(loader)) == 3
        world.save({"loader": loader}, f"{root}/short")
    with _loader(world, 3, max_steps=6) as loader:
        world.load({"loader": loader}, f"{root}/short")
        longer = list(loader)
    return messages, longer


def _onto_more_ranks(world: _World, root: str) -> Any:
    """A per-rank (IterableSource) state saved on 2 ranks, loaded on these 4: with DCP's
    default planner, and with a partial load that lets missing keys keep the loader's own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner

    from evenflow.engine.errors import ResumeError

    out: dict[str, Any] = {}
    with _loader(world, 1, kind="iterable") as loader:
        try:
            world.load({"loader": loader}, f"{root}/iterable-2-1")
        except CheckpointException as exc:  # a BaseException
            out["strict"] = str(exc)
        out["step"] = loader.step
    with _loader(world, 1, kind="iterable") as loader:
        try:
            dcp.load(
                {"loader": loader},
                checkpoint_id=f"{root}/iterable-2-1",
                process_group=world.dcp,
                planner=DefaultLoadPlanner(allow_partial_load=True),
            )
        except ResumeError as exc:
            out["partial"] = str(exc)
    return out


def _record_windowed(world: _World, root: str, spec: list[Any]) -> Any:
    """One uninterrupted epoch planned in balance windows, saved with DCP after each step in
    ``cuts`` and once the epoch is over; ``spec``: (window, kind, depth, cuts) as in
    ``WINDOWED``."""
    window, kind, depth, cuts = spec
    batches = []
    with _loader(world, depth, kind, balance_window=window) as loader:
        for batch in loader:
            batches.append(batch)
            if loader.step in cuts:
                world.save({"loader": loader}, f"{root}/window-{world.size}-{loader.step}")
        # The epoch's last window ended early (with the source): over, it is a boundary.
        if loader.step not in cuts:
            world.save({"loader": loader}, f"{root}/window-{world.size}-{loader.step}")
    return batches


def _resume_windowed(world: _World, root: str, runs: list[tuple[int, int, int, str, int]]) -> Any:
    """Per (saved ranks, cut, depth, kind, window): the rest of epoch 0 after ``dcp.load``
    and epoch 1, or the text of the ``ResumeError`` that refused the restore."""
    from evenflow.engine.errors import ResumeError

    out: list[Any] = []
    for saved, cut, depth, kind, window in runs:
        with _loader(world, depth, kind, balance_window=window) as loader:
            try:
                world.load({"loader": loader}, f"{root}/window-{saved}-{cut}")
            except ResumeError as exc:
                out.append(str(exc))
                continue
            assert loader.step == cut
            rest = list(loader)
            loader.set_epoch(1)
            out.append((rest, list(loader)))
    return out


# -- the oracle: the source's own dealing ----------------------------------------------------


def _dealt(saved: int, cut: int, num_ranks: int) -> tuple[list[list[int]], list[list[int]]]:
    """The samples of every step (all ranks together) after restoring at ``cut`` steps of a
    ``saved``-rank epoch 0 onto ``num_ranks`` ranks, then of epoch 1."""
    old = _source(0, saved)
    for _ in itertools.islice(iter(old), cut):
        pass
    state = old.state_dict()
    rest: list[list[int]] = []
    following: list[list[int]] = []
    for rank in range(num_ranks):
        new = _source(rank, num_ranks)
        new.load_state_dict(state)
        for at, step in enumerate(new):
            _add(rest, at, [int(s["id"]) for b in step for s in b])
        new.set_epoch(1)
        for at, step in enumerate(new):
            _add(following, at, [int(s["id"]) for b in step for s in b])
    return rest, following


def _add(steps: list[list[int]], at: int, ids: list[int]) -> None:
    while len(steps) <= at:
        steps.append([])
    steps[at] += ids


def _per_step(runs: list[list[list[list[int]]]]) -> list[list[int]]:
    """Every rank's batches of one run -> the sorted samples of each step, all ranks."""
    steps: list[list[int]] = []
    for batches in runs:
        for at, batch in enumerate(batches):
            _add(steps, at, [i for b in batch for i in b])
    return [sorted(s) for s in steps]


def _windows(steps: list[list[int]], window: int, first: int = 0) -> list[list[int]]:
    """The samples of consecutive steps, the first one step ``first`` (a window's first
    step) -> the sorted samples of each balance window of ``window`` steps."""
    out: list[list[int]] = []
    for at, ids in enumerate(steps):
        _add(out, (first + at) // window - first // window, ids)
    return [sorted(w) for w in out]


# -- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Four processes; runs on fewer ranks use the first ones (see ``_within``)."""
    with RankPool(4, timeout=10.0, deadline=120.0) as pool:
        yield pool


def _run(pool: RankPool, size: int, fn: Any, *args: Any) -> list[Any]:
    return pool.run(_within, size, fn.__name__, *args, deadline=120.0)[:size]


@pytest.fixture(scope="module")
def recorded(pool: RankPool, root: Path) -> dict[int, Any]:
    """The uninterrupted epoch on 4 ranks (payload mode, saved with depth 3) and on 2
    (shared-dataset mode, depth 1)."""
    return {
        4: _run(pool, 4, _record, str(root), "dataset", 3, CUTS4),
        2: _run(pool, 2, _record, str(root), "shared", 1, CUTS2),
    }


#: (ranks saved, cut, prefetch depth restored, source mode) per number of restoring ranks;
#: "dataset" moves payloads, "shared" reads the assigned samples on each rank.
RUNS = {
    2: [(4, 1, 1, "dataset"), (4, 3, 3, "shared"), (2, 2, 3, "shared")],
    3: [(4, 2, 1, "shared"), (4, 4, 3, "dataset")],
    4: [(2, 3, 1, "dataset"), (4, 2, 3, "dataset")],
}


@pytest.mark.parametrize("ranks", sorted(RUNS))
def test_a_dcp_checkpoint_restores_onto_any_number_of_ranks(
    pool: RankPool, root: Path, recorded: dict[int, Any], ranks: int
) -> None:
    resumed = _run(pool, ranks, _resume, str(root), RUNS[ranks])
    everything = {r["id"] for r in _rows()}
    for at, (saved, cut, depth, kind) in enumerate(RUNS[ranks]):
        where = f"{saved} -> {ranks} ranks at step {cut}, depth {depth}, {kind}"
        before = _per_step([batches[:cut] for batches in recorded[saved]])
        rest = _per_step([r[at][0] for r in resumed])
        following = _per_step([r[at][1] for r in resumed])
        want_rest, want_following = _dealt(saved, cut, ranks)
        # The rest of the epoch, step by step over all ranks, is the source's dealing ...
        assert rest == [sorted(s) for s in want_rest], where
        assert following == [sorted(s) for s in want_following], where
        # ... so the epoch delivers every sample at most once, and all but the remainder.
        epoch = collections.Counter(i for step in before + rest for i in step)
        assert max(epoch.values()) == 1, where
        report = _source(0, ranks)
        report.load_state_dict(_state_at(saved, cut))
        assert len(everything - set(epoch)) == report.report.num_dropped_samples, where
        if saved == ranks:  # the same ranks: bitwise the uninterrupted run, per rank
            for rank in range(ranks):
                assert resumed[rank][at][0] == recorded[saved][rank][cut:], (where, rank)


def _state_at(saved: int, cut: int) -> dict[str, Any]:
    source = _source(0, saved)
    for _ in itertools.islice(iter(source), cut):
        pass
    return source.state_dict()


def test_wrong_restores_are_refused_on_every_rank_and_max_steps_may_grow(
    pool: RankPool, root: Path, recorded: dict[int, Any]
) -> None:
    results = _run(pool, 2, _refusals, str(root))
    for rank, (messages, longer) in enumerate(results):
        assert "config.seq_len was 64 and is now 72" in messages["seq_len"], rank
        assert "keeps a position of its own on each rank" in messages["iterable"], rank
        assert "saved at different steps" in messages["skewed"], rank
        # Extending max_steps from 3 to 6 delivers steps 3..5 of the uninterrupted run.
        assert longer == recorded[2][rank][3:6], rank


def test_a_per_rank_source_restored_onto_more_ranks_is_refused_on_every_rank(
    pool: RankPool, root: Path, recorded: dict[int, Any]
) -> None:
    """Ranks 2 and 3 have no entry in a 2-rank checkpoint: DCP's planner refuses the keys they
    ask for before any state is read, and reports it on every rank; nothing is restored."""
    results = _run(pool, 4, _onto_more_ranks, str(root))
    per_rank = "keeps a position of its own on each rank"
    for rank, out in enumerate(results):
        # The default planner: every rank raises, naming the keys ranks 2 and 3 lack.
        for missing in (2, 3):
            assert (
                f"Missing key in checkpoint state_dict: loader.ranks.{missing}." in (out["strict"])
            ), rank
        assert out["step"] == 0, rank
        # A partial load reaches load_state_dict: ranks 0 and 1 find their 2-rank entries,
        # ranks 2 and 3 only their own; each refuses, naming why.
        if rank < 2:
            assert f"saved as group rank {rank} of the group [0, 1]" in out["partial"], rank
        else:
            assert "the checkpoint has no entry for this rank" in out["partial"], rank
        assert per_rank in out["partial"], rank


#: Uninterrupted epochs planned in balance windows: ranks -> (window, mode, depth, cuts); each
#: saved at window boundaries and inside a window.
WINDOWED = {4: (2, "dataset", 3, (1, 2, 4)), 2: (3, "shared", 1, (3, 4))}

#: The cut after the whole epoch: 29 steps on 2 ranks, whose last window of 3 ends early.
END = -1

#: (ranks saved, cut, prefetch depth restored, source mode) per number of restoring ranks: at
#: a boundary onto other ranks, inside a window onto the same ranks (bitwise) and onto other
#: ranks (refused).
WINDOW_RUNS = {
    2: [(4, 2, 1, "shared"), (4, 4, 3, "dataset"), (2, 4, 3, "shared"), (4, 1, 1, "dataset")],
    3: [(4, 2, 3, "shared"), (2, 3, 1, "dataset"), (2, 4, 1, "dataset"), (2, END, 3, "shared")],
    4: [(2, 3, 3, "dataset"), (4, 1, 1, "shared"), (2, 4, 1, "shared"), (2, END, 1, "dataset")],
}


@pytest.fixture(scope="module")
def recorded_windows(pool: RankPool, root: Path) -> dict[int, Any]:
    return {
        ranks: _run(pool, ranks, _record_windowed, str(root), spec)
        for ranks, spec in WINDOWED.items()
    }


def test_balance_windows_move_samples_between_the_steps_of_a_window(
    recorded_windows: dict[int, Any],
) -> None:
    """The windowed runs below are worth checking per window: each epoch delivers the
    source's dealing window by window, but not step by step."""
    for ranks, (window, *_) in WINDOWED.items():
        delivered = _per_step(recorded_windows[ranks])
        dealt = [sorted(s) for s in _dealt(ranks, 0, ranks)[0]]
        assert _windows(delivered, window) == _windows(dealt, window), ranks
        assert delivered != dealt, ranks


@pytest.mark.parametrize("ranks", sorted(WINDOW_RUNS))
def test_a_windowed_checkpoint_changes_ranks_at_a_window_boundary_only(
    pool: RankPool, root: Path, recorded_windows: dict[int, Any], ranks: int
) -> None:
    runs = [
        (saved, len(recorded_windows[saved][0]) if cut == END else cut, depth, kind, window)
        for saved, cut, depth, kind in WINDOW_RUNS[ranks]
        for window in [WINDOWED[saved][0]]
    ]
    resumed = _run(pool, ranks, _resume_windowed, str(root), runs)
    everything = {r["id"] for r in _rows()}
    for at, (saved, cut, depth, kind, window) in enumerate(runs):
        where = f"{saved} -> {ranks} ranks at step {cut}, window {window}, depth {depth}, {kind}"
        results = [r[at] for r in resumed]
        over = cut == len(recorded_windows[saved][0])  # the epoch is over: no window is open
        if cut % window and not over and saved != ranks:
            # Inside a window onto other ranks: refused on every rank, naming the window.
            for rank, message in enumerate(results):
                assert isinstance(message, str), (where, rank)
                assert f"saved at step {cut}, inside a balance window of {window} steps" in (
                    message
                ), (where, rank)
                assert f"Restore onto {saved} ranks" in message, (where, rank)
            continue
        assert not any(isinstance(r, str) for r in results), (where, results)
        before = _per_step([batches[:cut] for batches in recorded_windows[saved]])
        rest = _per_step([r[0] for r in results])
        following = _per_step([r[1] for r in results])
        want_rest, want_following = _dealt(saved, cut, ranks)
        # The next epoch is the new ranks' dealing, planned window by window.
        assert _windows(following, window) == _windows(want_following, window), where
        if cut % window and not over:
            # Inside a window onto the same ranks: bitwise the uninterrupted run, per rank.
            for rank in range(ranks):
                assert results[rank][0] == recorded_windows[saved][rank][cut:], (where, rank)
            continue
        # At a boundary (or the end): the rest of the epoch is the source's dealing onto the
        # new ranks, window by window (samples move between a window's steps, never out) ...
        assert _windows(rest, window, cut) == _windows(want_rest, window, cut), where
        # ... so the epoch delivers every sample at most once, and all but the remainder.
        epoch = collections.Counter(i for step in before + rest for i in step)
        assert max(epoch.values()) == 1, where
        report = _source(0, ranks)
        report.load_state_dict(_state_at(saved, cut))
        assert len(everything - set(epoch)) == report.report.num_dropped_samples, where
