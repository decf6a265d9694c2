"""The rank side of the launcher, and the plain data it exchanges with the parent.

:func:`rank_main` is what every spawned process runs: it joins the torch.distributed world
over loopback, then serves the parent's ``run`` requests until ``stop``. Nothing crosses the
pipe pickled: a function travels as its module, qualified name and file
(:func:`describe_function`, :func:`resolve_function`), arguments, results and control
messages as msgpack (:func:`pack`, :func:`unpack`), and an exception as a
:class:`~evenflow.transports.internal.RemoteErrorInfo`. The parent side, and the guarantees of
the whole, are in :mod:`evenflow.transports.testing.launch`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from evenflow.transports._remote import RemoteErrorInfo

__all__ = ["describe_function", "pack", "rank_main", "resolve_function", "unpack"]


# -- plain-data codec for arguments, results and control messages ---------------------------


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def describe_function(fn: Callable[..., Any]) -> dict[str, str]:
    """Name ``fn`` so a freshly spawned process can import it (no pickle)."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, but got {fn!r} ({type(fn).__name__}).")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise TypeError(
            f"fn must be a module-level function so that spawned ranks can import it by name, "
            f"but got {fn!r}; move it to the top level of a module."
        )
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None) or ""
    return {"module": module, "qualname": qualname, "file": path}


def resolve_function(desc: Mapping[str, str]) -> Callable[..., Any]:
    """Inverse of :func:`describe_function`, run inside a rank."""
    module_name, path = desc["module"], desc["file"]
    if module_name == "__main__":
        # spawn re-runs the parent's main script as __mp_main__ in every child.
        module_name = "__mp_main__"
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            # Test files imported by pytest in importlib mode are not importable by name.
            if not path:
                raise
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in desc["qualname"].split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{desc['module']}.{desc['qualname']} is not callable.")
    fn: Callable[..., Any] = obj
    return fn


# -- the rank side ----------------------------------------------------------------------------


def _watch_parent() -> None:
    """Exit this rank as soon as the parent process is gone (no orphans)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(70)

    threading.Thread(target=watch, name="evenflow-launch-lifeline", daemon=True).start()


def _send_error(conn: Connection, exc: BaseException, rank: int, phase: str) -> None:
    info = RemoteErrorInfo.from_exception(exc, rank=rank, stage=phase, step=None)
    with contextlib.suppress(Exception):
        conn.send_bytes(pack({"kind": "error", "error": info.to_wire()}))


def rank_main(
    *,
    rank: int,
    num_ranks: int,
    port: int,
    backend: str,
    timeout: float,
    env: dict[str, str],
    conn: Connection,
) -> None:
    """Entry point of one rank: init the world, then serve ``run`` requests until ``stop``."""
    _watch_parent()
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(num_ranks),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(num_ranks),
        }
    )
    os.environ.update(env)
    try:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    except BaseException as exc:
        _send_error(conn, exc, rank, "init")
        _flush_and_exit(1)
    conn.send_bytes(pack({"kind": "ready"}))
    while True:
        try:
            request = unpack(conn.recv_bytes())
        except EOFError:
            _flush_and_exit(0)
        if request["kind"] == "stop":
            break
        try:
            fn = resolve_function(request)
            result = fn(rank, num_ranks, *request["args"])
            try:
                reply = pack({"kind": "result", "value": result})
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(
                    f"rank {rank}: the result of {request['qualname']} is not plain data "
                    f"(msgpack could not encode it: {exc}); return None, numbers, strings, "
                    f"bytes, lists or dicts."
                ) from exc
        except BaseException as exc:
            # Exit right after reporting: peers blocked on this rank then fail at once with a
            # closed connection instead of waiting for the group timeout.
            _send_error(conn, exc, rank, "run")
            _flush_and_exit(1)
        conn.send_bytes(reply)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    _flush_and_exit(0)


def _flush_and_exit(code: int) -> None:
    # os._exit skips interpreter shutdown, which could block on threads fn left behind.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
