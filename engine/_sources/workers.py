"""Per-sample transforms, in the training process or in worker processes.

A ``DatasetSource`` with a ``transform`` reads each sample and then calls
``transform(sample, rng)``; with ``transform_workers=N > 0`` both happen in ``N`` worker
processes, so heavy Python work (tokenizing, a chat template, decoding an image) does not
hold the training process's GIL.

**Determinism.** ``rng`` is a ``numpy.random.Generator`` seeded by ``(seed, epoch, dataset
index)`` alone: a sample gets the same random state whichever worker, rank or step reads it,
so a sample moved by the plan, shared-dataset mode and any worker count (0 included) give
bitwise the same samples. An ``IterableSource`` has no dataset index: its training process
iterates the stream and sends the raw samples of each packed step to the workers, and the
key is ``(seed, epoch, step, slot)``, the sample's place in the steps the stream yields.

**Processes.** Workers start with ``forkserver`` (``spawn`` where the platform lacks it),
never ``fork``: forking a process that runs threads can copy a held lock and deadlock. The
fork server imports this module once, so each worker starts in milliseconds instead of
importing torch again. They start on the first read and are reused until ``close()``,
across epochs and passes. Each worker gets the dataset and the transform once (pickled at
start, as ``DataLoader`` does under spawn), reads ``dataset[i]`` itself and sends back the
transformed sample. Samples whose numpy arrays are large travel through a shared-memory
segment (pickle protocol 5, out-of-band buffers): the worker writes the arrays once, the
training process maps the segment and the arrays are read in place, with no copy and no GIL
time proportional to their size.

**Failures.** A transform that raises fails the read with its own exception, a note naming
the dataset index and the worker's traceback as another note (notes travel to the other
ranks with the step's error). A worker that dies (the OOM killer's SIGKILL: its process
sentinel fires) or does not answer within ``timeout`` fails the read with
:class:`TransformWorkerError`; every worker is then stopped, and the next read starts a fresh
set. ``close()`` stops and reaps every worker within a bounded time (SIGTERM, then SIGKILL),
and a worker exits by itself when the training process dies (a thread of the worker watches
the training process's pid).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from evenflow.engine.errors import ConfigError
from evenflow.transports.internal import NOTE_PREFIX

__all__ = [
    "check_transform",
    "read_samples",
    "remove_segments",
    "sample_rng",
    "start_context",
    "stop_workers",
    "stream_rng",
    "transform_samples",
    "transform_stream",
    "unpack",
    "worker_main",
]

logger = logging.getLogger("evenflow")

#: Out-of-band buffers at least this large in total go through shared memory; smaller
#: results are cheaper through the pipe.
SHM_MIN_BYTES = 64 * 1024
_SHM_DIR = "/dev/shm"
_PARENT_POLL_S = 0.5


def check_transform(transform: Any, workers: int) -> None:
    """Refuse a transform that is not callable, or that worker processes cannot receive."""
    if transform is None:
        return
    if not callable(transform):
        raise TypeError(f"transform must be callable, but got {transform!r:.80}.")
    if workers:
        try:
            pickle.dumps(transform)
        except Exception as exc:
            raise ConfigError(
                f"transform={transform!r:.80} cannot be sent to transform_workers={workers} "
                f"worker processes: pickling it failed ({type(exc).__name__}: {exc}). Define "
                "it as a module-level function (not a lambda or a closure), or pass "
                "transform_workers=0 to run it on the loader's threads."
            ) from exc


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random state of dataset index ``index`` in ``epoch``: a function of these three
    numbers only, so the same on every worker and rank."""
    return np.random.default_rng([seed, epoch, index])


def stream_rng(seed: int, epoch: int, step: int, slot: int) -> np.random.Generator:
    """The random state of an ``IterableSource`` sample: a stream has no dataset index, so
    the key is the sample's place in the stream's steps (slot: its position in the step as
    yielded), which is the same for any worker count, rank or resume."""
    return np.random.default_rng([seed, epoch, step, slot])


def transform_stream(
    samples: list[Any],
    transform: Callable[[Any, np.random.Generator], Any],
    *,
    seed: int,
    epoch: int,
    step: int,
    first_slot: int = 0,
) -> list[Any]:
    """``transform(sample, rng)`` for a stream step's samples from slot ``first_slot`` on; an
    error gains a note naming the stream position (epoch, step, slot)."""
    out = []
    for slot, sample in enumerate(samples, start=first_slot):
        try:
            out.append(transform(sample, stream_rng(seed, epoch, step, slot)))
        except BaseException as exc:
            exc.add_note(
                f"{NOTE_PREFIX}raised by the transform on the stream's sample of epoch "
                f"{epoch}, step {step}, slot {slot}."
            )
            raise
    return out


def read_samples(dataset: Any, indices: Sequence[int]) -> list[Any]:
    """The samples at ``indices`` (one ``__getitems__`` call where the dataset has it).

    An error the dataset raises keeps its type and message and gains a note naming the
    dataset index (or, for one ``__getitems__`` call, the indices) it was reading."""
    getitems = getattr(dataset, "__getitems__", None)
    wanted = list(indices)
    if callable(getitems):
        try:
            return list(getitems(wanted))
        except BaseException as exc:
            shown = ", ".join(map(str, wanted[:16])) + (", ..." if len(wanted) > 16 else "")
            exc.add_note(
                f"{NOTE_PREFIX}raised by dataset.__getitems__ for dataset indices [{shown}]."
            )
            raise
    out = []
    for i in wanted:
        try:
            out.append(dataset[i])
        except BaseException as exc:
            exc.add_note(f"{NOTE_PREFIX}raised reading dataset index {i} (dataset[{i}]).")
            raise
    return out


def transform_samples(
    samples: list[Any],
    indices: Sequence[int],
    transform: Callable[[Any, np.random.Generator], Any],
    seed: int,
    epoch: int,
) -> list[Any]:
    """``transform(sample, rng)`` for each sample; an error gains a note naming its index."""
    out = []
    for sample, index in zip(samples, indices, strict=True):
        try:
            out.append(transform(sample, sample_rng(seed, epoch, int(index))))
        except BaseException as exc:
            exc.add_note(f"{NOTE_PREFIX}raised by the transform on dataset index {index}.")
            raise
    return out


# -- the worker process ---------------------------------------------------------------------


def _segment_prefix(pid: int) -> str:
    return f"evenflow-{pid}-"


def remove_segments(pid: int) -> None:
    """Unlink the shared-memory segments worker ``pid`` wrote and nobody claimed (the parent
    unlinks a segment as soon as it maps it, so what is left was never received)."""
    prefix = _segment_prefix(pid)
    with contextlib.suppress(OSError):
        for name in os.listdir(_SHM_DIR):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(_SHM_DIR, name))


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when the training process is gone (even inside a long transform):
    its pid no longer exists, or this worker was re-parented (its direct parent, the
    training process or the fork server, died)."""
    first_parent = os.getppid()
    while True:
        time.sleep(_PARENT_POLL_S)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            remove_segments(os.getpid())
            os._exit(1)
        except PermissionError:  # the pid exists (reused by another user's process)
            pass
        if os.getppid() != first_parent:
            remove_segments(os.getpid())
            os._exit(1)


def worker_main(
    conn: multiprocessing.connection.Connection,
    dataset: Any,
    transform: Callable[[Any, np.random.Generator], Any] | None,
    seed: int,
    parent_pid: int,
) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the training process closed the pipe or died
            return
        if message is None:
            return
        task, epoch, work = message
        started = time.perf_counter()
        try:
            if isinstance(work, tuple):  # ("samples", step, first slot, a stream's samples)
                _, step, first, raw = work
                out = (
                    raw
                    if transform is None
                    else transform_stream(
                        raw, transform, seed=seed, epoch=epoch, step=step, first_slot=first
                    )
                )
            else:  # dataset indices: read, then transform
                samples = read_samples(dataset, work)
                out = (
                    samples
                    if transform is None
                    else transform_samples(samples, work, transform, seed, epoch)
                )
            ended = time.perf_counter()  # CLOCK_MONOTONIC: comparable with the parent's
            reply = ("ok", task, _pack(out), ended - started, started, ended)
        except Exception as exc:
            reply = ("error", task, _portable(exc), traceback.format_exc())
        try:
            conn.send(reply)
        except (EOFError, OSError):  # the training process is gone: nobody maps the result
            _discard(reply)
            return
        except Exception as exc:  # the samples cannot be pickled
            _discard(reply)
            conn.send(("error", task, _portable(exc), traceback.format_exc()))


def _discard(reply: tuple[Any, ...]) -> None:
    """Unlink the shared-memory segment of a result that was never sent."""
    if reply[0] == "ok" and reply[2][0] == "shm":
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM_DIR, reply[2][2]))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (with its notes), else a RuntimeError saying what it
    was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        replacement = RuntimeError(f"{type(exc).__name__}: {exc}")
        for note in getattr(exc, "__notes__", []):
            replacement.add_note(note)
        return replacement


def _pack(samples: list[Any]) -> tuple[Any, ...]:
    """The samples as ``("pickle", data)``, or ``("shm", data, name, bounds)`` when their
    out-of-band buffers are large: written once into a shared-memory file the parent maps."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(samples, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    total = sum(v.nbytes for v in views)
    if total < SHM_MIN_BYTES or not os.path.isdir(_SHM_DIR):
        return ("pickle", pickle.dumps(samples, protocol=5))
    name = f"{_segment_prefix(os.getpid())}{uuid.uuid4().hex[:12]}"
    fd = os.open(os.path.join(_SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total) as segment:
            bounds, at = [], 0
            for v in views:
                segment[at : at + v.nbytes] = v
                bounds.append((at, at + v.nbytes))
                at += v.nbytes
    except BaseException:
        os.unlink(os.path.join(_SHM_DIR, name))
        raise
    finally:
        os.close(fd)
    return ("shm", data, name, bounds)


def unpack(packed: tuple[Any, ...]) -> list[Any]:
    if packed[0] == "pickle":
        return pickle.loads(packed[1])  # type: ignore[no-any-return]
    _, data, name, bounds = packed
    path = os.path.join(_SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        segment = mmap.mmap(fd, bounds[-1][1] if bounds else 1)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping lives on until its last array is freed
    view = memoryview(segment)
    return pickle.loads(data, buffers=[view[a:b] for a, b in bounds])  # type: ignore[no-any-return]


def start_context() -> Any:
    """``forkserver`` where the platform has it, else ``spawn``; never ``fork``.

    The fork server is a fresh interpreter that imports this module (and with it torch)
    once; each worker is then forked from it in milliseconds, where a spawned worker would
    import torch again (about a second each, more on a busy host)."""
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is None:  # not started: preload us
        context.set_forkserver_preload([__name__])
    return context


def stop_workers(workers: list[Any], timeout: float) -> list[int]:
    """Ask, then terminate, then kill ``workers``, reaping each; returns their pids."""
    for w in workers:
        with contextlib.suppress(Exception):
            w.conn.send(None)
    until = time.monotonic() + max(timeout, 0.0) / 2
    for w in workers:
        w.process.join(max(until - time.monotonic(), 0.0))
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    until = time.monotonic() + max(timeout, 0.0) / 2
    for w in workers:
        w.process.join(max(until - time.monotonic(), 0.0))
    for w in workers:
        if w.process.is_alive():
            w.process.kill()
            w.process.join(5.0)
        w.conn.close()
        if w.process.exitcode is not None:  # results it sent that were never read
            remove_segments(w.process.pid)
    return [w.process.pid for w in workers]
