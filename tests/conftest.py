"""Shared fixtures.

Tests run with ``--import-mode=importlib``, so a test module cannot import a sibling module;
helpers under ``tests/`` are loaded here by path instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

_TESTS = Path(__file__).resolve().parent


def load_test_module(relative: str) -> ModuleType:
    """The module at ``tests/<relative>``, loaded by path (once per process)."""
    name = "evenflow_tests." + relative.removesuffix(".py").replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, _TESTS / relative)
    assert spec is not None and spec.loader is not None, relative
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def planning_oracle() -> ModuleType:
    """``tests/oracles/planning.py``: slow reference kernels of the planner's compiled core."""
    return load_test_module("oracles/planning.py")


@pytest.fixture(scope="session")
def grouped_oracle() -> ModuleType:
    """``tests/oracles/grouped.py``: the slow reference of the compiled grouped search."""
    return load_test_module("oracles/grouped.py")
