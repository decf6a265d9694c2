"""The shared byte protocol: the torch.distributed error mapper and the one exchange layout.

The error messages below are what torch 2.13 (CPU build) raised on two or three real Gloo
ranks over loopback: a peer that never joined (timeouts), a peer killed with ``os._exit``
(closed / reset connections), ``monitored_barrier`` with a sleeping rank, and mismatched
``all_to_all_single`` sizes. Gloo never reported an abort on CPU; the aborted case is the
message torch's NCCL backend builds (``ProcessGroupNCCL``), for the table's other kind.
"""

from __future__ import annotations

from typing import Any

import pytest

from evenflow.transports._channel import Channel
from evenflow.transports._protocol import (
    ERROR_TYPES,
    FAILED,
    Protocol,
    classify_failure,
    map_dist_error,
    pack_outgoing,
    unpack_into,
)
from evenflow.transports.errors import (
    PeerFailureError,
    TransportError,
    TransportTimeoutError,
    WireFormatError,
)

_GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo"
_SEND_TIMEOUT = (
    f"{_GLOO}/transport/tcp/unbound_buffer.cc:129] Timed out waiting 2000ms for send "
    "operation to complete"
)
_RECV_TIMEOUT = (
    f"{_GLOO}/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv "
    "operation to complete"
)
_CLOSED = (
    f"{_GLOO}/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35511. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker "
    "before reporting an error. GLHF! \U0001f3d6\ufe0f"
)
_RESET = (
    f"{_GLOO}/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1936: Connection reset by "
    "peer. This is typically caused by a remote worker hanging or bugs in the application. "
    "Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)
_MONITORED = (
    "[Rank 0]: Rank 2 failed to pass monitoredBarrier in 2000 ms\n Original exception: \n"
    + _RECV_TIMEOUT
)
_MONITORED_BYSTANDER = (
    "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for "
    "send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n"
    + _RECV_TIMEOUT
)
_SIZES = (
    "[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/alltoall.cc:30] "
    "in->size == out->size. "
)
_ABORTED = "NCCL communicator was aborted on rank 1. "
_ABORTED_BY_WATCHDOG = (
    "NCCL communicator was aborted on rank 2. Original reason for failure was: watchdog "
    "callback timed out"
)

# (message, group size, this rank, expected type, expected peer_rank)
_CASES: list[tuple[str, int, int, type[TransportError], int | None]] = [
    (_SEND_TIMEOUT, 2, 0, TransportTimeoutError, 1),
    (_RECV_TIMEOUT, 2, 1, TransportTimeoutError, 0),
    (_SEND_TIMEOUT, 3, 0, TransportTimeoutError, None),
    (_CLOSED, 2, 0, PeerFailureError, 1),
    (_CLOSED, 3, 1, PeerFailureError, None),
    (_RESET, 3, 0, PeerFailureError, None),
    (_MONITORED, 3, 0, TransportTimeoutError, 2),
    (_MONITORED_BYSTANDER, 3, 1, TransportTimeoutError, None),
    (_SIZES, 2, 0, TransportError, None),
    (_ABORTED, 2, 0, PeerFailureError, None),
    (_ABORTED_BY_WATCHDOG, 4, 2, TransportTimeoutError, None),
]


@pytest.mark.parametrize(("text", "num_ranks", "rank", "expected", "peer"), _CASES)
def test_torch_messages_map_to_their_kind_and_name_the_failed_peer(
    text: str, num_ranks: int, rank: int, expected: type[TransportError], peer: int | None
) -> None:
    global_ranks = tuple(range(10, 10 + num_ranks))
    error = map_dist_error(
        RuntimeError(text),
        where=f"Rank {rank} (test group)",
        op="exchange",
        rank=rank,
        global_ranks=global_ranks,
        advice="Close it.",
    )
    assert type(error) is expected
    assert (error.rank, error.op, error.peer_rank) == (rank, "exchange", peer)
    message = str(error)
    assert message.startswith(f"Rank {rank} (test group): exchange failed (")
    assert text.strip() in message and message.endswith("Close it.")
    if peer is None:
        assert "failed peer" not in message
    else:
        assert f"group rank {peer} (global rank {global_ranks[peer]})" in message


def test_every_failure_kind_has_a_project_error_type() -> None:
    assert {classify_failure(t) for t, *_ in _CASES} == set(ERROR_TYPES)
    assert classify_failure("something odd") == "other"
    assert all(issubclass(cls, TransportError) for cls in ERROR_TYPES.values())


def test_a_named_rank_outside_the_group_is_not_blamed() -> None:
    error = map_dist_error(
        RuntimeError("Rank 7 failed to pass monitoredBarrier in 2000 ms"),
        where="Rank 0",
        op="barrier",
        rank=0,
        global_ranks=(0, 1, 2),
        advice="",
    )
    assert error.peer_rank is None


def _protocol(rank: int = 0, num_ranks: int = 2) -> Protocol:
    return Protocol(
        rank=rank,
        num_ranks=num_ranks,
        global_ranks=tuple(range(4, 4 + num_ranks)),
        name="gloo",
        limit=1024,
    )


def test_a_failed_collective_is_mapped_chained_and_remembered() -> None:
    channel = Channel(None, _protocol())  # type: ignore[arg-type]  # no collective reaches it
    cause = RuntimeError(_CLOSED)

    def call() -> None:
        raise cause

    with pytest.raises(PeerFailureError) as info:
        channel.collective("all_gather", call)
    assert info.value.__cause__ is cause
    assert info.value.peer_rank == 1 and "[4, 5]" in str(info.value)
    assert channel.broken is info.value
    # Other exceptions are not torch.distributed failures: they pass unchanged.
    with pytest.raises(KeyError):
        channel.collective("all_gather", lambda: {}["x"])


def test_refused_sizes_leave_the_channel_broken_but_a_peer_encode_failure_does_not() -> None:
    channel = Channel(None, _protocol(num_ranks=3))  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="could not build"):
        channel.check("exchange", [0, FAILED, 64])
    assert channel.broken is None
    with pytest.raises(WireFormatError, match=r"\(2, 2048\)"):
        channel.check("exchange", [0, 64, 2048])
    assert isinstance(channel.broken, TransportError)


# -- the exchange layout -----------------------------------------------------------------------


def test_outgoing_becomes_keys_and_payloads_per_non_empty_target() -> None:
    packed = pack_outgoing(0, {0: [], 2: [((1, 2), "a"), ((3,), b"b")], 1: (((4,), None),)})
    assert packed == {2: [[(1, 2), (3,)], ["a", b"b"]], 1: [[(4,)], [None]]}
    received: dict[Any, Any] = {}
    for sender, value in sorted(packed.items()):
        unpack_into(received, value, rank=0, sender=sender, op="exchange")
    assert received == {(4,): None, (1, 2): "a", (3,): b"b"}


@pytest.mark.parametrize(
    ("outgoing", "match"),
    [
        ({1: "ab"}, r"outgoing\[1\] must be a list of \(key, payload\) pairs, but got 'ab'"),
        ({1: 5}, r"outgoing\[1\] must be a list of .* \(int\)"),
        ({0: [[1, 2]]}, r"must be a \(key, payload\) tuple, but got \[1, 2\]"),
        ({0: [(1, 2, 3)]}, r"must be a \(key, payload\) tuple, but got \(1, 2, 3\)"),
        ({0: [1]}, r"must be a \(key, payload\) tuple, but got 1"),
    ],
)
def test_malformed_outgoing_items_raise_type_error_naming_the_target(
    outgoing: Any, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        pack_outgoing(3, outgoing)


@pytest.mark.parametrize(
    "packed", [None, [[1]], [[1], [2], [3]], [(1,), [2]], [[1, 2], [3]], {"k": [1]}]
)
def test_a_malformed_message_from_a_peer_is_a_wire_format_error(packed: Any) -> None:
    with pytest.raises(WireFormatError, match="malformed message from rank 2"):
        unpack_into({}, packed, rank=0, sender=2, op="exchange")


def test_a_key_from_two_senders_is_refused() -> None:
    received: dict[Any, Any] = {}
    unpack_into(received, [[(7,)], ["x"]], rank=0, sender=0, op="exchange")
    with pytest.raises(TransportError, match=r"key \(7,\) more than once \(again from rank 1\)"):
        unpack_into(received, [[(7,)], ["y"]], rank=0, sender=1, op="exchange")


def test_merge_skips_senders_that_sent_nothing() -> None:
    merged = _protocol(num_ranks=3).merge_exchange("exchange", [None, [[(1,)], [2]], None])
    assert merged == {(1,): 2}
