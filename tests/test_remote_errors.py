"""Remote errors: one plain-data format for every path a failure takes between ranks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine._distributed.loader import decode_error, encode_error
from evenflow.engine._pipeline.step import error_info, remote_error
from evenflow.engine.errors import ConfigError, RemoteStageError, SourceExhaustedError
from evenflow.transports import InProcessGroup, Transport
from evenflow.transports._remote import (
    MAX_MESSAGE_CHARS,
    MAX_TRACEBACK_CHARS,
    RemoteErrorInfo,
    one_line,
)
from evenflow.transports.errors import WireFormatError
from evenflow.transports.testing import WrappedTransport

SEQ_LEN = 64


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def _failing_helper() -> None:
    raise KeyError("shard 7 is missing")


def _raised_in_helper() -> BaseException:
    try:
        _failing_helper()
    except KeyError as exc:
        return exc
    raise AssertionError("unreachable")


# -- the codec ----------------------------------------------------------------------------------


def test_round_trip_through_msgpack_keeps_every_field() -> None:
    info = RemoteErrorInfo.from_exception(_raised_in_helper(), rank=3, stage="pack", step=9)
    data = msgpack.unpackb(msgpack.packb(info.to_wire()), raw=False)
    back = RemoteErrorInfo.from_wire(data, sender="rank 3")
    assert back == info
    assert (back.rank, back.stage, back.step) == (3, "pack", 9)
    assert (back.error_type, back.module, back.qualified_type) == (
        "KeyError",
        "builtins",
        "builtins.KeyError",
    )
    assert back.message == "'shard 7 is missing'"
    assert "in _failing_helper" in back.traceback
    assert back.derives_from(LookupError) and not back.derives_from(TypeError)


def test_texts_are_bounded_keeping_the_messages_head_and_the_tracebacks_tail() -> None:
    exc = _raised(ValueError("head " + "x" * (2 * MAX_MESSAGE_CHARS)))
    exc.add_note("y" * (2 * MAX_TRACEBACK_CHARS) + " tail")
    info = RemoteErrorInfo.from_exception(exc, rank=0, stage="source", step=0)
    assert len(info.message) == MAX_MESSAGE_CHARS and info.message.startswith("head ")
    assert len(info.traceback) == MAX_TRACEBACK_CHARS
    assert info.traceback.startswith("[... ") and info.traceback.rstrip().endswith("tail")
    RemoteErrorInfo.from_wire(info.to_wire(), sender="rank 0")  # within what receivers accept


def test_an_exception_whose_str_raises_is_still_described() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    info = RemoteErrorInfo.from_exception(Unprintable(), rank=0, stage="pack", step=1)
    assert info.message.startswith("<unprintable ") and info.message.endswith(".Unprintable>")


def _valid() -> dict[str, Any]:
    return RemoteErrorInfo.from_exception(KeyError("k"), rank=1, stage="pack", step=2).to_wire()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (None, "expected a mapping"),
        ({"v": 99}, "field 'v' is 99"),
        ({"rank": "1"}, "field 'rank' must be a non-negative integer"),
        ({"rank": True}, "field 'rank' must be a non-negative integer"),
        ({"step": -2}, "field 'step' must be a non-negative integer"),
        ({"type": ""}, "field 'type' is empty"),
        ({"type": 5}, "field 'type' must be a string"),
        ({"message": None}, "field 'message' must be a string"),
        ({"message": "m" * (MAX_MESSAGE_CHARS + 1)}, "more than 4000"),
        ({"traceback": b"bytes"}, "field 'traceback' must be a string"),
        ({"lineage": "builtins.KeyError"}, "field 'lineage' must be a list"),
        ({"lineage": [1, 2]}, "non-string or over-long name"),
    ],
)
def test_garbage_from_a_peer_is_rejected_clearly(
    change: dict[str, Any] | None, reason: str
) -> None:
    data: Any = "not a mapping" if change is None else {**_valid(), **change}
    with pytest.raises(WireFormatError, match="Malformed error report from rank 5") as info:
        RemoteErrorInfo.from_wire(data, sender="rank 5")
    assert reason in str(info.value)


def test_one_line_folds_line_breaks() -> None:
    assert one_line("first\n  second\r\n\nthird ") == "first second third"


# -- RemoteStageError ----------------------------------------------------------------------------


def test_remote_stage_error_is_one_line_and_shows_the_traceback_in_notes_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    info = error_info(1, "pack", 4, _raised(ValueError("bad\nsample")))
    error = remote_error(info, (10, 11), sender=1)
    assert isinstance(error, RemoteStageError)
    assert str(error) == "Rank 11 failed in stage 'pack' at step 4: ValueError: bad sample"
    assert error.remote_message == "bad\nsample"
    assert "in _raised" in error.remote_traceback
    assert error.__notes__ == [f"Remote traceback (rank 11):\n{error.remote_traceback.rstrip()}"]
    with caplog.at_level(logging.ERROR, logger="evenflow.test"):
        try:
            raise error
        except RemoteStageError:
            logging.getLogger("evenflow.test").exception("step failed")
    assert "in _raised" in caplog.text and "Remote traceback (rank 11)" in caplog.text


@pytest.mark.parametrize(
    "info",
    [
        {"rank": 0},
        None,
        {**_valid(), "rank": 7},  # outside the two-rank group
        {**_valid(), "step": None},
    ],
)
def test_garbage_announcements_become_a_clear_error(info: Any) -> None:
    error = remote_error(info, (10, 11), sender=1)
    assert isinstance(error, WireFormatError)
    assert "Malformed error report from rank 11" in str(error)


# -- the model-parallel broadcast ----------------------------------------------------------------


def test_the_broadcast_forwards_the_origin_and_its_traceback() -> None:
    origin = remote_error(error_info(1, "exchange", 6, _raised(OSError("disk"))), (4, 5), sender=1)
    assert isinstance(origin, RemoteStageError)
    again = decode_error(encode_error(origin, rank=4, step=6))
    assert isinstance(again, RemoteStageError)
    assert (again.failed_rank, again.stage, again.step, again.error_type) == (
        5,
        "exchange",
        6,
        "OSError",
    )
    assert (
        again.remote_traceback == origin.remote_traceback and "in _raised" in again.remote_traceback
    )
    local = decode_error(encode_error(_raised_in_helper(), rank=2, step=9))
    assert isinstance(local, RemoteStageError) and "in _failing_helper" in local.remote_traceback
    same = decode_error(encode_error(_raised(SourceExhaustedError("dry")), rank=0, step=1))
    assert type(same) is SourceExhaustedError and str(same) == "dry"
    assert "in _raised" in same.__notes__[0]


@pytest.mark.parametrize(
    "data",
    [None, {"kind": "other", "info": _valid()}, {"kind": "remote", "info": {"v": 1}}],
)
def test_garbage_broadcast_errors_are_rejected(data: Any) -> None:
    error = decode_error(data)
    assert isinstance(error, WireFormatError) and "Malformed error" in str(error)


# -- an in-process group ---------------------------------------------------------------------------


class _Source:
    def __init__(self, rank: int, fail_at: int | None = None) -> None:
        self.rank, self.fail_at = rank, fail_at

    def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
        for step in range(4):
            if step == self.fail_at:
                _fail_reading(step)
            yield [
                [{"input_ids": np.full(3 + b + self.rank, step, dtype=np.int32)}] for b in range(2)
            ]


def _fail_reading(step: int) -> None:
    raise ConfigError(f"record {step} is unreadable")


class _GarbleErrors(WrappedTransport):
    """Delegates to an in-process member, replacing every announced error with garbage."""

    name: ClassVar[str] = "garble-errors"

    async def all_gather(self, obj: Any) -> list[Any]:
        messages = await super().all_gather(obj)
        return [
            {**m, "error": {"rank": "?"}} if m.get("error") is not None else m for m in messages
        ]


async def _run_group(*, garble: bool) -> list[BaseException]:
    group = InProcessGroup(2, timeout=20.0)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, log_stats=False)
    loaders = []
    for r in range(2):
        transport: Transport = group.transport(r)
        if garble and r == 0:
            transport = _GarbleErrors(transport)
        loaders.append(
            BalancedLoader(
                _Source(r, fail_at=2 if r == 1 else None), config=config, transport=transport
            )
        )

    async def one(loader: BalancedLoader) -> BaseException:
        try:
            async with loader:
                async for _ in loader:
                    pass
        except Exception as exc:
            return exc
        raise AssertionError("no error surfaced")

    return list(await asyncio.wait_for(asyncio.gather(*(one(ld) for ld in loaders)), 20.0))


@pytest.mark.asyncio
async def test_a_peers_error_carries_the_failing_ranks_traceback() -> None:
    remote, own = await _run_group(garble=False)
    assert isinstance(own, ConfigError)
    assert isinstance(remote, RemoteStageError)
    assert (remote.failed_rank, remote.stage, remote.step) == (1, "source", 2)
    assert "\n" not in str(remote)
    assert "in _fail_reading" in remote.remote_traceback
    assert 'raise ConfigError(f"record {step} is unreadable")' in remote.remote_traceback
    assert "in _fail_reading" in remote.__notes__[0]


@pytest.mark.asyncio
async def test_a_garbled_announcement_fails_the_rank_clearly() -> None:
    garbled, own = await _run_group(garble=True)
    assert isinstance(own, ConfigError)
    assert isinstance(garbled, WireFormatError)
    assert "Malformed error report from rank 1: field 'v' is None" in str(garbled)
