from __future__ import annotations

import gc
import threading
import weakref
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from evenflow.engine._pipeline.h2d import DeviceStager, StagedBatch
from evenflow.engine.errors import ConfigError, LoaderStateError

# -- a recording stand-in for torch.cuda / torch.npu -------------------------------------------


class _Event:
    def __init__(self, log: list[tuple[Any, ...]], number: int) -> None:
        self.log = log
        self.number = number
        self.done = False

    def record(self, stream: _Stream) -> None:
        self.log.append(("event.record", self.number, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("event.synchronize", self.number))
        self.done = True


class _Stream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log = log
        self.name = name

    def synchronize(self) -> None:
        self.log.append(("stream.synchronize", self.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("stream.wait_event", self.name, event.number))


class _StreamContext:
    def __init__(self, module: _FakeDeviceModule, stream: _Stream) -> None:
        self.module = module
        self.stream = stream

    def __enter__(self) -> None:
        self.module.active = self.stream

    def __exit__(self, *exc: object) -> None:
        self.module.active = self.module.compute


class _FakeDeviceModule:
    """Implements the slice of torch.cuda the stager uses and logs every call."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.compute = _Stream(self.log, "compute")
        self.active = self.compute
        self.events: list[_Event] = []
        self.num_streams = 0

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def set_device(self, device: torch.device) -> None:
        self.log.append(("set_device", str(device), threading.get_ident()))

    def synchronize(self) -> None:  # device-wide: the stager must never call it
        self.log.append(("device.synchronize",))

    def Stream(self, device: torch.device) -> _Stream:
        self.num_streams += 1
        self.log.append(("Stream", str(device)))
        return _Stream(self.log, f"copy{self.num_streams}")

    def Event(self) -> _Event:
        event = _Event(self.log, len(self.events))
        self.events.append(event)
        return event

    def stream(self, stream: _Stream) -> _StreamContext:
        return _StreamContext(self, stream)

    def current_stream(self, device: torch.device | None = None) -> _Stream:
        return self.compute


class _Leaf:
    """A tensor-like leaf: pinnable, movable, recordable; logs through the module."""

    def __init__(self, module: _FakeDeviceModule, name: str, where: str = "cpu") -> None:
        self.module = module
        self.name = name
        self.where = where

    def pin_memory(self) -> _Leaf:
        self.module.log.append(("pin", self.name))
        return _Leaf(self.module, self.name, "pinned")

    def to(self, device: torch.device, *, non_blocking: bool = False) -> _Leaf:
        self.module.log.append(("to", self.name, self.where, self.module.active.name, non_blocking))
        return _Leaf(self.module, self.name, str(device))

    def record_stream(self, stream: _Stream) -> None:
        self.module.log.append(("record_stream", self.name, stream.name))


def _stager(module: _FakeDeviceModule, **kwargs: Any) -> DeviceStager:
    return DeviceStager("cuda:0", _device_module=module, **kwargs)


# -- inactive (host) path ----------------------------------------------------------------------


class _Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the inactive stager touched the device module ({name})")


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_inactive_stager_passes_host_batches_through(device: Any) -> None:
    stager = DeviceStager(device, _device_module=_Untouchable())
    batch = {"input_ids": torch.arange(4), "ids": ["a"]}
    staged = stager.stage(batch)
    assert staged is batch
    assert stager.deliver(staged) is batch
    assert not stager.active
    assert not batch["input_ids"].is_pinned()
    stager.close()
    stager.close()
    with pytest.raises(LoaderStateError, match="after close"):
        stager.stage(batch)


def test_inactive_stager_still_checks_cpu_fields_needs_a_mapping() -> None:
    stager = DeviceStager(None, cpu_fields=("ids",))
    assert stager.stage({"ids": [1]}) == {"ids": [1]}
    with pytest.raises(TypeError, match=r"cpu_fields=\['ids'\] needs a mapping batch"):
        stager.stage([torch.arange(2)])


def test_unavailable_accelerator_is_a_clear_config_error() -> None:
    if torch.cuda.is_available():  # pragma: no cover - CPU CI only
        pytest.skip("an accelerator is present")
    with pytest.raises(ConfigError, match=r"device 'cuda:0' is not available"):
        DeviceStager("cuda:0")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device": 5}, TypeError, "device must be None"),
        ({"device": "warp-drive"}, ConfigError, "device must be None"),
        ({"device": None, "cpu_fields": "ids"}, ConfigError, r"pass a tuple such as \('ids',\)"),
        ({"device": None, "cpu_fields": 5}, TypeError, "cpu_fields must be a collection"),
        ({"device": None, "move_fn": 3}, TypeError, "move_fn must be callable"),
        ({"device": None, "pin_memory": "yes"}, ConfigError, "pin_memory"),
    ],
)
def test_constructor_validates(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DeviceStager(**kwargs)


def test_device_without_streams_is_rejected() -> None:
    class NoStreams:
        def current_device(self) -> int:
            return 0

    with pytest.raises(ConfigError, match="does not support streams"):
        DeviceStager("cuda", _device_module=NoStreams())


# -- accelerator path, on the fake module ------------------------------------------------------


def test_stage_and_deliver_call_order() -> None:
    module = _FakeDeviceModule()
    stager = _stager(module)
    assert stager.active
    assert stager.device == torch.device("cuda", 0)
    host = {"input_ids": _Leaf(module, "ids"), "nested": [(_Leaf(module, "pos"), 7)]}

    staged = stager.stage(host)
    assert isinstance(staged, StagedBatch)
    assert staged.host is host
    tid = threading.get_ident()
    assert module.log == [
        ("set_device", "cuda:0", tid),
        ("Stream", "cuda:0"),
        ("pin", "ids"),
        ("pin", "pos"),
        ("to", "ids", "pinned", "copy1", True),
        ("to", "pos", "pinned", "copy1", True),
        ("event.record", 0, "copy1"),
    ]

    module.log.clear()
    batch = stager.deliver(staged)
    assert module.log == [
        ("stream.wait_event", "compute", 0),
        ("record_stream", "ids", "compute"),
        ("record_stream", "pos", "compute"),
    ]
    assert batch["input_ids"].where == "cuda:0"
    assert batch["nested"][0][1] == 7

    # A second batch reuses the stream and the thread binding.
    module.log.clear()
    stager.stage({"input_ids": _Leaf(module, "ids2")})
    assert [entry[0] for entry in module.log] == ["pin", "to", "event.record"]
    assert module.num_streams == 1
    stager.close()


def test_pinned_staging_is_kept_until_its_event_completes() -> None:
    module = _FakeDeviceModule()
    stager = _stager(module)
    pinned: list[weakref.ref[_Leaf]] = []
    original = _Leaf.pin_memory

    def tracking_pin(leaf: _Leaf) -> _Leaf:
        result = original(leaf)
        pinned.append(weakref.ref(result))
        return result

    leaf_type: Any = _Leaf
    leaf_type.pin_memory = tracking_pin
    try:
        first = stager.deliver(stager.stage({"x": _Leaf(module, "a")}))
        second = stager.stage({"x": _Leaf(module, "b")})
    finally:
        leaf_type.pin_memory = original
    gc.collect()
    assert stager.num_retained == 2
    assert all(ref() is not None for ref in pinned)

    module.events[0].done = True
    stager.deliver(second)
    gc.collect()
    assert stager.num_retained == 1
    assert pinned[0]() is None  # released: its copy finished
    assert pinned[1]() is not None  # still feeding an unfinished copy
    assert first["x"].where == "cuda:0"

    module.log.clear()
    stager.close()
    gc.collect()
    assert module.log == [("event.synchronize", 1)]
    assert stager.num_retained == 0
    assert pinned[1]() is None
    stager.close()
    assert module.log == [("event.synchronize", 1)]
    with pytest.raises(LoaderStateError, match="after close"):
        stager.deliver(second)


def test_close_synchronises_every_retained_event() -> None:
    module = _FakeDeviceModule()
    stager = _stager(module)
    for name in "abc":
        stager.stage({"x": _Leaf(module, name)})
    module.log.clear()
    stager.close()
    assert module.log == [
        ("event.synchronize", 0),
        ("event.synchronize", 1),
        ("event.synchronize", 2),
    ]


def test_failed_move_synchronises_only_the_copy_stream_and_drops_the_staging() -> None:
    module = _FakeDeviceModule()
    seen: list[weakref.ref[Any]] = []

    def failing_move(batch: Any, device: torch.device) -> Any:
        seen.append(weakref.ref(batch["x"]))
        batch["x"].to(device, non_blocking=True)
        raise RuntimeError("device out of memory")

    stager = _stager(module, move_fn=failing_move)
    with pytest.raises(RuntimeError, match="out of memory") as excinfo:
        stager.stage({"x": _Leaf(module, "a")})
    del excinfo  # its traceback holds move_fn's frame, which holds the staging
    gc.collect()
    names = [entry[0] for entry in module.log]
    assert names[-1] == "stream.synchronize"
    assert module.log[-1] == ("stream.synchronize", "copy1")
    assert "device.synchronize" not in names
    assert "event.record" not in names
    assert stager.num_retained == 0
    assert seen[0]() is None
    stager.close()


def test_cpu_fields_stay_on_the_host_untouched() -> None:
    module = _FakeDeviceModule()
    stager = _stager(module, cpu_fields=("meta", "ids", "absent"))
    meta = _Leaf(module, "meta")
    ids = ["doc-1", "doc-2"]
    host = {"meta": meta, "tokens": _Leaf(module, "tokens"), "ids": ids}
    batch = stager.deliver(stager.stage(host))
    assert list(batch) == ["meta", "tokens", "ids"]
    assert batch["meta"] is meta
    assert batch["ids"] is ids
    assert batch["tokens"].where == "cuda:0"
    touched = {entry[1] for entry in module.log if entry[0] in ("pin", "to", "record_stream")}
    assert touched == {"tokens"}
    with pytest.raises(TypeError, match="cpu_fields"):
        stager.stage((meta,))
    stager.close()


def test_move_fn_runs_inside_the_copy_stream_on_the_pinned_batch() -> None:
    module = _FakeDeviceModule()
    calls: list[tuple[str, str, torch.device]] = []

    def move(batch: Any, device: torch.device) -> Any:
        calls.append((batch["x"].where, module.active.name, device))
        return {"x": "moved", "extra": 1}

    stager = _stager(module, move_fn=move, cpu_fields=("keep",))
    batch = stager.deliver(stager.stage({"keep": 5, "x": _Leaf(module, "x")}))
    assert calls == [("pinned", "copy1", torch.device("cuda", 0))]
    assert batch == {"keep": 5, "x": "moved", "extra": 1}

    bad = _stager(module, move_fn=lambda batch, device: [batch], cpu_fields=("keep",))
    module.log.clear()
    with pytest.raises(TypeError, match="move_fn must return a mapping"):
        bad.stage({"keep": 5, "x": _Leaf(module, "x")})
    assert module.log[-1] == ("stream.synchronize", "copy2")  # treated as a failed move
    assert bad.num_retained == 0
    stager.close()
    bad.close()


def test_mapping_type_survives_cpu_fields() -> None:
    module = _FakeDeviceModule()
    stager = _stager(module, cpu_fields=("absent",))
    batch = stager.deliver(stager.stage(OrderedDict(b=_Leaf(module, "b"), a=3)))
    assert isinstance(batch, OrderedDict)
    assert list(batch) == ["b", "a"]
    assert batch["b"].where == "cuda:0"
    stager.close()


def test_pin_memory_false_skips_pinning() -> None:
    module = _FakeDeviceModule()
    stager = _stager(module, pin_memory=False)
    stager.stage([_Leaf(module, "a")])
    assert [entry for entry in module.log if entry[0] == "to"] == [
        ("to", "a", "cpu", "copy1", True)
    ]
    assert not [entry for entry in module.log if entry[0] == "pin"]
    stager.close()


def test_each_worker_thread_binds_the_device_once() -> None:
    module = _FakeDeviceModule()
    stager = DeviceStager("cuda", _device_module=module)  # index resolved via current_device()
    assert stager.device == torch.device("cuda", 0)

    def work() -> None:
        for _ in range(2):
            stager.stage({"x": _Leaf(module, "x")})

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
        thread.join(timeout=30)  # one at a time, as the loader's worker does
    # Thread idents may be reused once a thread ends; the binding is per thread object.
    assert [entry[0] for entry in module.log].count("set_device") == 2
    assert module.num_streams == 1
    stager.close()


def test_deliver_rejects_what_stage_did_not_return() -> None:
    stager = _stager(_FakeDeviceModule())
    with pytest.raises(TypeError, match="StagedBatch"):
        stager.deliver({"x": 1})
    stager.close()


Pair = namedtuple("Pair", ["tokens", "label"])


def test_real_tensors_are_pinned_moved_and_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU build cannot pin or stream, so those two tensor methods are stood in for; the
    # default mover's real ``.to(non_blocking=True)`` runs against the meta device.
    module = _FakeDeviceModule()
    pinned: list[torch.Tensor] = []
    recorded: list[tuple[tuple[int, ...], str]] = []

    def fake_pin(self: torch.Tensor) -> torch.Tensor:
        pinned.append(self)
        return self.clone()

    def fake_record(self: torch.Tensor, stream: _Stream) -> None:
        recorded.append((tuple(self.shape), stream.name))

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "record_stream", fake_record)
    stager = DeviceStager("meta", _device_module=module)
    tokens, label = torch.arange(6), torch.zeros(2)
    host: dict[str, Any] = {"pair": Pair(tokens, label), "step": 3, "name": "bin0"}
    batch = stager.deliver(stager.stage(host))
    assert [t is tokens or t is label for t in pinned] == [True, True]
    assert isinstance(batch["pair"], Pair)
    assert batch["pair"].tokens.device.type == "meta"
    assert batch["pair"].tokens.shape == (6,)
    assert batch["step"] == 3
    assert batch["name"] == "bin0"
    assert recorded == [((6,), "compute"), ((2,), "compute")]
    assert host["pair"].tokens is tokens  # the host view is left as it was
    stager.close()
