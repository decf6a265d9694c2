"""The Chrome-trace (Perfetto) format: writing one rank's spans, merging ranks' files.

Every timestamp is relative to ``_EPOCH_PERF``, an instant taken when this module is imported;
its wall-clock time goes into the file, so traces of different processes can be aligned when
merged.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any, Final

from evenflow.engine.errors import ConfigError

__all__ = ["merge_chrome_traces", "write_chrome_trace"]

_EPOCH_PERF: Final = perf_counter()
_EPOCH_UNIX: Final = time.time()

# (step, stage, start, end, queue_depth, attrs): a span without its rank.
_Record = tuple[int, str, float, float, int, "dict[str, Any] | None"]


def write_chrome_trace(
    path: Path, rank: int, tracks: Mapping[str, int], records: Iterable[_Record]
) -> None:
    """Write one rank's spans as a Chrome trace: one track per stage, atomically replaced."""
    pid = rank
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
    ]
    for stage, tid in tracks.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": stage}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    for step, stage, start, end, queue_depth, attrs in records:
        args: dict[str, Any] = {"step": step, "queue_depth": queue_depth}
        if attrs:
            args.update(attrs)
        events.append(
            {
                "name": stage,
                "cat": "evenflow",
                "ph": "X",
                "pid": pid,
                "tid": tracks[stage],
                "ts": (start - _EPOCH_PERF) * 1e6,
                "dur": max(0.0, end - start) * 1e6,
                "args": args,
            }
        )
    document = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"evenflow_epoch_unix": _EPOCH_UNIX, "rank": pid},
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, default=repr), encoding="utf-8")
    tmp.replace(path)  # readers never see a half-written trace


def merge_chrome_traces(
    paths: Iterable[str | os.PathLike[str]], out_path: str | os.PathLike[str]
) -> Path:
    """Merge per-rank Chrome traces into one file (one process track per rank).

    Timestamps are shifted onto a common clock using the wall-clock epoch each evenflow trace
    records (exact for ranks on one machine, as good as clock synchronisation across machines);
    files without one (other tools' traces) are taken as they are. Accepts the JSON object and
    the bare-array formats; writes the object format. Returns the output path.
    """
    sources = [Path(os.fspath(p)) for p in paths]
    if not sources:
        raise ConfigError("paths must name at least one Chrome-trace file, but got none.")
    loaded: list[tuple[list[dict[str, Any]], float | None]] = []
    for source in sources:
        with source.open(encoding="utf-8") as handle:
            document = json.load(handle)
        epoch: float | None = None
        if isinstance(document, list):
            events = document
        elif isinstance(document, Mapping) and isinstance(document.get("traceEvents"), list):
            events = document["traceEvents"]
            other = document.get("otherData")
            if isinstance(other, Mapping) and isinstance(
                other.get("evenflow_epoch_unix"), (int, float)
            ):
                epoch = float(other["evenflow_epoch_unix"])
        else:
            raise ConfigError(
                f"paths must name Chrome-trace JSON files, but {str(source)!r} holds neither a "
                "list of events nor an object with a 'traceEvents' list."
            )
        loaded.append((events, epoch))
    epochs = [epoch for _, epoch in loaded if epoch is not None]
    base = min(epochs) if epochs else 0.0
    merged: list[dict[str, Any]] = []
    for events, epoch in loaded:
        shift = (epoch - base) * 1e6 if epoch is not None else 0.0
        for event in events:
            if shift and isinstance(event, dict) and isinstance(event.get("ts"), (int, float)):
                merged.append({**event, "ts": event["ts"] + shift})
            else:
                merged.append(event)
    target = Path(os.fspath(out_path))
    target.parent.mkdir(parents=True, exist_ok=True)
    document_out: dict[str, Any] = {"traceEvents": merged, "displayTimeUnit": "ms"}
    if epochs:
        document_out["otherData"] = {"evenflow_epoch_unix": base}
    target.write_text(json.dumps(document_out), encoding="utf-8")
    return target
