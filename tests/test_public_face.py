"""The public faces: which names each audience finds where, and what those names report.

``evenflow.engine`` serves loop users and observers, ``evenflow.engine.planning`` cost-model and
balancing-algorithm authors, ``evenflow.engine.testing`` a source author's conformance check,
``evenflow.transports`` transport users and authors.
The sets below are the surface's snapshot: a name added to or dropped from a face changes this
file in the same commit. Each face declares a name once (``transports/_face.py``); these tests
hold the run-time face to what a type checker reads from the same lines.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pickle
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

import evenflow.engine
import evenflow.engine.planning
import evenflow.engine.testing
from evenflow.transports import _face
from evenflow.transports.internal import serve

ROOT = Path(__file__).resolve().parent.parent

LOOP_USERS = {
    "BalancedLoader",
    "DatasetSource",
    "DistributedLoader",
    "IndexedSample",
    "IterableSource",
    "LoaderConfig",
    "LossTokens",
    "OversizedPolicy",
    "PackedSteps",
    "SampleMetadata",
    "build_loader",
    "count_loss_tokens",
    "default_collate_fn",
    "default_pack_fn",
    "errors",
    "pack_lengths",
}
OBSERVERS = {
    "BalanceDecision",
    "CalibrationStats",
    "NullTracer",
    "PassSummary",
    "RankUnread",
    "SourceReport",
    "StepTransform",
    "TransformReport",
    "StepStats",
    "Tracer",
    "UnevenEnd",
    "merge_chrome_traces",
}
COST_MODEL_AUTHORS = {
    "CalibratedCost",
    "ComponentCost",
    "CostModel",
    "FlopsCost",
    "QuadraticCost",
    "TokenCost",
    "VisionLanguageCost",
}
ALGORITHM_AUTHORS = {
    "BalanceProblem",
    "BalancingAlgorithm",
    "BinPlan",
    "FlatLayout",
    "LPTAlgorithm",
    "PackingConstraints",
    "Plan",
    "Planner",
    "RefineAlgorithm",
    "SampleKey",
}
TRANSPORTS = {
    "DEFAULT_MAX_FRAME_BYTES",
    "DeviceTransport",
    "GlooTransport",
    "InProcessGroup",
    "InProcessStatistics",
    "InProcessTransport",
    "InlineLauncher",
    "Launcher",
    "LocalTransport",
    "Prepared",
    "Transport",
    "create_transport",
    "decode",
    "decode_many",
    "encode",
    "encode_many",
    "errors",
    "prepare",
    "register_transport",
}
FACES = {
    "evenflow.engine": LOOP_USERS | OBSERVERS,
    "evenflow.engine.planning": COST_MODEL_AUTHORS | ALGORITHM_AUTHORS,
    "evenflow.engine.testing": {"check_step_source"},
    "evenflow.transports": TRANSPORTS,
}


def _served(face: str) -> list[tuple[str, object]]:
    module = importlib.import_module(face)
    return [(name, getattr(module, name)) for name in module.__all__]


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_serves_its_audiences_names_sorted(face: str) -> None:
    module = importlib.import_module(face)
    assert set(module.__all__) == FACES[face]
    assert module.__all__ == sorted(module.__all__)
    assert set(module.__all__) <= set(dir(module))


def test_every_public_object_has_one_public_home() -> None:
    homes: dict[int, list[str]] = {}
    for face in FACES:
        for name, value in _served(face):
            homes.setdefault(id(value), []).append(f"{face}.{name}")
    shared = [names for names in homes.values() if len(names) > 1]
    assert not shared, shared


@pytest.mark.parametrize("face", sorted(FACES))
def test_classes_and_functions_report_their_public_home(face: str) -> None:
    checked = 0
    for name, value in _served(face):
        if isinstance(value, (type, types.FunctionType)):
            assert value.__module__ == face, name
            assert value.__qualname__ == name
            assert getattr(importlib.import_module(value.__module__), name) is value
            checked += 1
    assert checked >= len(FACES[face]) - 2, checked  # all but a module and a constant or alias


@pytest.mark.parametrize("face", sorted(FACES))
def test_type_hints_resolve_after_the_public_stamp(face: str) -> None:
    """``get_type_hints`` looks names up in ``sys.modules[cls.__module__]``; the face stores a
    class's annotations evaluated in its defining module, so it answers as before the stamp."""
    for name, value in _served(face):
        if isinstance(value, type):
            hints = typing.get_type_hints(value)
            assert all(not isinstance(hint, str) for hint in hints.values()), name
    assert typing.get_type_hints(evenflow.engine.LoaderConfig)["seq_len"] is int


def test_a_name_moved_to_planning_is_refused_with_its_new_home() -> None:
    with pytest.raises(AttributeError, match=r"evenflow\.engine\.planning; import it from there"):
        _ = evenflow.engine.Planner
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        _ = evenflow.engine.NoSuchName
    assert not hasattr(evenflow.engine, "RefineAlgorithm")


def test_instances_of_stamped_classes_pickle_and_copy_by_their_public_path() -> None:
    from evenflow.engine import LoaderConfig, SampleMetadata
    from evenflow.engine.planning import QuadraticCost, SampleKey

    values = [
        LoaderConfig(seq_len=64, bins_per_rank=2),
        SampleMetadata(tokens=5),
        SampleKey(source_rank=1, step=2, index=3),
        QuadraticCost(linear=64.0),
    ]
    for value in values:
        blob = pickle.dumps(value)
        assert type(value).__module__.encode() in blob
        again = pickle.loads(blob)
        assert type(again) is type(value)
        assert repr(again) == repr(value)
        assert repr(copy.deepcopy(value)) == repr(value)


def test_a_face_imports_the_modules_behind_its_lazy_names_on_first_access() -> None:
    """A run that never names a lazy name never imports its module: the faces cost what the
    root needs (errors, the sample model), not the pipeline or the planner."""
    code = (
        "import sys, evenflow.engine, evenflow.engine.planning\n"
        "lazy = ['evenflow.engine._pipeline.loader', 'evenflow.engine._planning.planner']\n"
        "print([m for m in lazy if m in sys.modules])\n"
        "evenflow.engine.BalancedLoader\n"
        "print('evenflow.engine._pipeline.loader' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    assert out[:2] == ["[]", "True"], out


def test_the_declaration_reader_sees_eager_and_lazy_reexports_only() -> None:
    source = inspect.cleandoc(
        """
        from typing import TYPE_CHECKING
        from evenflow.engine import _face
        from evenflow.engine._model import SampleMetadata as SampleMetadata
        from evenflow.engine._model import SampleKey as Key
        if TYPE_CHECKING:
            from evenflow.engine._config import LoaderConfig as LoaderConfig
            from evenflow.engine._config import thing
        """
    )
    eager, lazy = _face.declared_names(source)
    assert eager == {"SampleMetadata": "evenflow.engine._model"}
    assert lazy == {"LoaderConfig": "evenflow.engine._config"}
    twice = source + "\n    from evenflow.engine._model import SampleMetadata as SampleMetadata"
    with pytest.raises(ImportError, match=r"\['SampleMetadata'\] both eagerly and lazily"):
        _face.declared_names(twice)


@pytest.mark.parametrize(
    ("face", "path"),
    [
        ("evenflow.engine", "engine/__init__.py"),
        ("evenflow.engine.planning", "engine/planning.py"),
        ("evenflow.transports", "transports/__init__.py"),
        ("evenflow.transports.internal", "transports/internal.py"),
    ],
)
def test_each_lazy_declaration_names_the_module_that_defines_it(face: str, path: str) -> None:
    """The one line a type checker reads is the line the run imports from: same module, same
    object."""
    eager, lazy = _face.declared_names((ROOT / path).read_text(encoding="utf-8"))
    module = importlib.import_module(face)
    assert set(eager) | set(lazy) == set(module.__all__)
    for name, home in {**eager, **lazy}.items():
        assert getattr(importlib.import_module(home), name) is getattr(module, name), name


def test_the_internal_face_leaves_its_names_modules_alone() -> None:
    """``evenflow.transports.internal`` is the engine's, not a documented home: its names keep
    the module that defines them."""
    from evenflow.transports import internal

    assert internal.Protocol.__module__ == "evenflow.transports._protocol"
    assert internal.RemoteErrorInfo.__module__ == "evenflow.transports._remote"
    assert serve.__module__ == "evenflow.transports._face"
    assert "serve" in internal.__all__ and "Protocol" in internal.__all__


def test_classes_loaded_with_another_name_report_their_public_home_before_being_named() -> None:
    """A caller who names only BalancedLoader still gets StepStats objects from it: the face
    stamps every public class whose module the first access loaded, not only the one named."""
    code = (
        "import evenflow.engine as engine\n"
        "engine.BalancedLoader\n"
        "from evenflow.engine._pipeline.stats import StepStats\n"
        "from evenflow.engine._sources.transform_pool import StepTransform\n"
        "print(StepStats.__module__, StepTransform.__module__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["evenflow.engine", "evenflow.engine"], done.stdout
