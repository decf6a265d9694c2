"""Transports by name: ``create_transport("gloo", ...)`` and users' own registrations.

Built-in transports are imported only when asked for, so choosing ``"local"`` never imports
``torch.distributed``, and a broken optional backend cannot break the others.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from evenflow.transports._base import Transport
from evenflow.transports._inprocess import InProcessGroup
from evenflow.transports.errors import ConfigError

__all__ = ["create_transport", "register_transport"]

#: A factory takes keyword arguments only and returns a ready transport.
TransportFactory = Callable[..., Transport]

# name -> (module, attribute); imported on first use.
_BUILTIN: dict[str, tuple[str, str]] = {
    "local": ("evenflow.transports._local", "LocalTransport"),
    "gloo": ("evenflow.transports._gloo", "GlooTransport"),
    "device": ("evenflow.transports._device", "DeviceTransport"),
}

#: Backend names users reach for, and the transport that runs on them.
_ALIASES = {
    "nccl": "device",
    "hccl": "device",
    "cuda": "device",
    "npu": "device",
    "cpu": "gloo",
    "inproc": "inprocess",
    "in_process": "inprocess",
}

_lock = threading.Lock()
_registered: dict[str, TransportFactory] = {}


def _known_names() -> list[str]:
    with _lock:
        return sorted({*_BUILTIN, "inprocess", *_registered})


def _create_inprocess(**kwargs: Any) -> Transport:

    missing = [name for name in ("group", "rank") if name not in kwargs]
    extra = sorted(set(kwargs) - {"group", "rank"})
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if extra:
            problems.append(f"unexpected {', '.join(extra)}")
        raise TypeError(
            f"create_transport('inprocess', ...) takes exactly group= (an InProcessGroup) and "
            f"rank= (a member rank): {'; '.join(problems)}. Set timeouts and delays on the group."
        )
    group = kwargs["group"]
    if not isinstance(group, InProcessGroup):
        raise TypeError(
            f"create_transport('inprocess', group=...) needs an InProcessGroup, but got "
            f"{group!r} ({type(group).__name__}); create one with InProcessGroup(num_ranks)."
        )
    return group.transport(kwargs["rank"])


def create_transport(name: str, **kwargs: Any) -> Transport:
    """Create the transport registered as ``name`` with the given keyword arguments.

    Built-in names: ``"local"`` (:class:`LocalTransport`), ``"inprocess"`` (needs ``group=``
    an :class:`InProcessGroup` and ``rank=``), ``"gloo"`` and ``"device"``; plus any name
    added with :func:`register_transport`. An unknown name raises ``ConfigError`` (a
    ``ValueError``) listing the known ones, with the right name for backend names such as
    ``"nccl"`` (``"device"``).
    """
    if not isinstance(name, str):
        raise TypeError(
            f"Transport name must be a string such as 'gloo', but got {name!r} "
            f"({type(name).__name__})."
        )
    with _lock:
        factory = _registered.get(name)
    if factory is None:
        if name == "inprocess":
            factory = _create_inprocess
        elif name in _BUILTIN:
            module_name, attribute = _BUILTIN[name]
            factory = getattr(importlib.import_module(module_name), attribute)
        else:
            known = ", ".join(repr(n) for n in _known_names())
            hint = _ALIASES.get(name.strip().lower())
            advice = (
                f" For {name!r}, use {hint!r}."
                if hint
                else " Register your own with evenflow.transports.register_transport(name, "
                "factory)."
            )
            raise ConfigError(f"Unknown transport {name!r}. Known transports: {known}.{advice}")
    transport = factory(**kwargs)
    if not isinstance(transport, Transport):
        raise TypeError(
            f"The factory of transport {name!r} returned {transport!r} "
            f"({type(transport).__name__}), which is not an evenflow Transport."
        )
    return transport


def register_transport(name: str, factory: TransportFactory, *, replace: bool = False) -> None:
    """Make ``create_transport(name, **kwargs)`` call ``factory(**kwargs)``.

    ``factory`` is usually a :class:`Transport` subclass. Registering a name that is already
    known (built-in or registered) raises ``ValueError`` unless ``replace=True``.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(
            f"Transport name must be a non-empty string without surrounding spaces, "
            f"but got {name!r}."
        )
    if not callable(factory):
        raise TypeError(
            f"factory for transport {name!r} must be callable (a Transport subclass or a "
            f"function returning one), but got {factory!r}."
        )
    with _lock:
        taken = name in _registered or name in _BUILTIN or name == "inprocess"
        if taken and not replace:
            raise ValueError(
                f"Transport name {name!r} is already registered; pass replace=True to "
                f"override it or choose another name."
            )
        _registered[name] = factory


def _unregister_transport(name: str) -> None:
    """Remove a user registration (tests use it to restore the registry)."""
    with _lock:
        _registered.pop(name, None)
