"""Balancing algorithms by name: ``"default"`` (= ``"refine"``) and ``"lpt"``."""

from __future__ import annotations

from collections.abc import Callable

from evenflow.engine._planning.lpt import LPTAlgorithm
from evenflow.engine._planning.problem import BalancingAlgorithm
from evenflow.engine._planning.refine import RefineAlgorithm
from evenflow.engine.errors import ConfigError

__all__ = ["ALGORITHMS", "resolve_algorithm"]

ALGORITHMS: dict[str, Callable[[], BalancingAlgorithm]] = {
    "default": RefineAlgorithm,
    "refine": RefineAlgorithm,
    "lpt": LPTAlgorithm,
}


def resolve_algorithm(value: object) -> BalancingAlgorithm:
    """A balancing algorithm from a name (``"default"``, ``"refine"``, ``"lpt"``) or object."""
    if isinstance(value, str):
        factory = ALGORITHMS.get(value)
        if factory is None:
            known = ", ".join(repr(name) for name in ALGORITHMS)
            raise ConfigError(
                f"algorithm must be one of {known} or an object with an assign(problem) "
                f"method, but got {value!r}."
            )
        return factory()
    if callable(getattr(value, "assign", None)):
        return value  # type: ignore[return-value]
    raise TypeError(
        f"algorithm must be a name ('default', 'refine', 'lpt') or an object with a callable "
        f"assign(problem) method, but got {value!r} ({type(value).__name__})."
    )
