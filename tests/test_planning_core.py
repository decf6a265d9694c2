"""The compiled planner core as part of the planner's identity."""

from __future__ import annotations

from typing import Any

import pytest

from evenflow.engine._distributed.build import _agreed_identity, _raise_on_mismatch
from evenflow.engine._planning import native
from evenflow.engine.errors import GroupMismatchError
from evenflow.engine.planning import Planner


class _Layout:
    def to_dict(self) -> dict[str, Any]:
        return {"groups": [[0, 1]]}


def _startup_record(planner_identity: dict[str, Any]) -> dict[str, Any]:
    """What a rank sends in build_loader's agreement round, for a loader with this planner."""
    loader_identity = {
        "config": {"seq_len": 512, "bins_per_rank": 2},
        "planner": planner_identity,
        "group": [0, 1],
        "transport": "gloo",
        "version": "0.1.0",
    }
    return {"error": None, "agree": _agreed_identity(loader_identity, "gloo", _Layout())}  # type: ignore[arg-type]


def test_planner_identity_names_the_compiled_core() -> None:
    identity = Planner(num_ranks=2, bins_per_rank=2, seq_len=512).identity()
    assert identity["core"] == "compiled"
    assert identity["core_version"] == native.CORE_VERSION
    assert isinstance(native.CORE_VERSION, int) and native.CORE_VERSION >= 1


def test_ranks_with_different_core_versions_are_refused_before_the_first_step() -> None:
    # build_loader gathers every rank's record and compares them before it returns a loader,
    # so no step runs in a group whose ranks would plan with different cores.
    mine = Planner(num_ranks=2, bins_per_rank=2, seq_len=512).identity()
    other = {**mine, "core_version": native.CORE_VERSION + 1}
    _raise_on_mismatch([_startup_record(mine), _startup_record(dict(mine))])  # same core: fine
    with pytest.raises(
        GroupMismatchError,
        match=rf"rank 1 differs in planner\.core_version: {native.CORE_VERSION + 1} vs "
        rf"{native.CORE_VERSION} on rank 0",
    ):
        _raise_on_mismatch([_startup_record(mine), _startup_record(other)])
