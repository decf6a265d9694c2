"""Helpers shared by the test modules: toy step sources, loader groups, thread runners,
balancing problems, a stand-in device. A test module imports helpers from here, never from
another test module.

pytest runs with ``--import-mode=importlib``, where test modules cannot import one another and a
``conftest.py`` is not importable by name (nor by the rank processes the multi-process tests
spawn). This package is on pytest's ``pythonpath`` (pyproject.toml), so test modules and spawned
ranks alike import it: ``from testkit.loaders import IdSource, make_loaders``. Fixtures live in
``conftest.py``.
"""
