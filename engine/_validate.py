"""Argument checks shared by every public constructor.

Each check raises ``ConfigError`` (a ``ValueError``) or ``TypeError`` with a full sentence that
names the parameter, the bad value and the fix. ``bool`` is never accepted where an integer or a
number is expected: ``True`` as a sequence length is always a bug.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from evenflow.engine.errors import ConfigError


def check_int(
    name: str, value: object, *, minimum: int = 0, maximum: int | None = None, why: str = ""
) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) ``>= minimum`` (and ``<= maximum``;
    ``why`` says where that limit comes from)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{name} must be an integer >= {minimum}, but got {value!r} "
            f"({type(value).__name__}); pass a plain int."
        )
    if value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, but got {value!r}.")
    if maximum is not None and value > maximum:
        raise ConfigError(
            f"{name} must be at most {maximum}{' (' + why + ')' if why else ''}, but got {value!r}."
        )
    return value


def check_optional_int(name: str, value: object, *, minimum: int = 0) -> int | None:
    """Like :func:`check_int` but also accepts ``None``."""
    return None if value is None else check_int(name, value, minimum=minimum)


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_minimum: bool = False,
    strict_maximum: bool = False,
) -> float:
    """Return ``float(value)`` for a finite int/float (not bool) inside the given bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, but got {value!r} ({type(value).__name__}).")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be finite, but got {value!r}.")
    if minimum is not None and (number <= minimum if strict_minimum else number < minimum):
        op = ">" if strict_minimum else ">="
        raise ConfigError(f"{name} must be {op} {minimum}, but got {value!r}.")
    if maximum is not None and (number >= maximum if strict_maximum else number > maximum):
        op = "<" if strict_maximum else "<="
        raise ConfigError(f"{name} must be {op} {maximum}, but got {value!r}.")
    return number


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices`` (strings)."""
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name} must be one of {options}, but got {value!r}.")
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a real ``bool``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, but got {value!r}.")
    return value


def check_callable(name: str, value: object) -> Any:
    """Return ``value`` if it is callable."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, but got {value!r} ({type(value).__name__}).")
    return value


def check_amounts(name: str, value: object) -> dict[str, float]:
    """Validate a mapping of non-empty string names to finite, non-negative numbers."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name} must be a mapping of names to non-negative numbers, but got {value!r}."
        )
    result: dict[str, float] = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{name} keys must be non-empty strings, but got {key!r}.")
        result[key] = check_number(f"{name}[{key!r}]", amount, minimum=0.0)
    return result
