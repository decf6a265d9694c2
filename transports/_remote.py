"""Remote errors as plain data: how one rank tells the others what it raised.

Every path on which a failure crosses a process boundary uses this one description: the
pipeline's fail-together round (in the metadata message), the model-parallel broadcast's error
announcement, ``build_loader``'s start-up agreement and the multi-process launcher. It is a
msgpack-able mapping, never a pickled exception::

    {"v": 1, "rank": int | None, "stage": str, "step": int | None,
     "type": str, "module": str, "message": str, "traceback": str, "lineage": [str, ...]}

``type`` and ``module`` name the exception's class (``KeyError`` / ``builtins``); ``lineage``
holds the qualified names of its classes, most derived first, so a receiver can ask what kind
of error it was (:meth:`RemoteErrorInfo.derives_from`) without importing, let alone
reconstructing, the sender's class. ``rank`` and ``step`` are None where they do not apply
(a launcher rank has no step). Texts are bounded: the head of the message (it says what went
wrong) and the tail of the traceback (its last frames say where) are kept.

A description that comes back from a peer is peer data: :meth:`RemoteErrorInfo.from_wire`
checks every field and raises :class:`~evenflow.transports.errors.WireFormatError` naming the
sender and the field, so a garbled or hostile report is a clear error and never a crash
(``KeyError``, ``TypeError``) in the receiver. Callers wrap the checked description into their
own error types; :func:`traceback_note` is the shared way to attach the remote traceback as a
``__notes__`` entry, which keeps ``str()`` one line while logging and tracebacks show it.
"""

from __future__ import annotations

import traceback as _traceback
from dataclasses import dataclass
from typing import Any

from evenflow.transports._threads import unwrap
from evenflow.transports.errors import WireFormatError

__all__ = [
    "MAX_MESSAGE_CHARS",
    "MAX_TRACEBACK_CHARS",
    "NOTE_PREFIX",
    "RemoteErrorInfo",
    "one_line",
    "traceback_note",
]

FORMAT_VERSION = 1
#: Longest message kept (its head).
MAX_MESSAGE_CHARS = 4000
#: Longest traceback text kept (its tail: the innermost frames and the final exception).
MAX_TRACEBACK_CHARS = 16000
#: Longest stage, type or module name, and most classes in a lineage, that a receiver accepts.
MAX_NAME_CHARS = 200
MAX_LINEAGE = 32

_CUT = "[... {n} earlier characters cut ...]\n"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: Notes (``BaseException.add_note``) that start with this travel with the message: the
#: engine adds them to user errors (e.g. which dataset index a failing bin held) without
#: changing the error's type or its own message.
NOTE_PREFIX = "evenflow: "


def _text_of(exc: BaseException) -> str:
    # A user exception's __str__ may itself raise; the report must still go out.
    try:
        text = str(exc)
    except Exception:
        text = f"<unprintable {type(exc).__qualname__}>"
    notes = [
        n for n in getattr(exc, "__notes__", ()) if isinstance(n, str) and n.startswith(NOTE_PREFIX)
    ]
    return "\n".join([text, *notes]) if notes else text


def _traceback_of(exc: BaseException) -> str:
    try:
        return "".join(_traceback.format_exception(exc))
    except Exception:
        return ""


def _tail(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = _CUT.format(n=len(text) - limit)
    return marker + text[len(text) - limit + len(marker) :]


def one_line(text: str) -> str:
    """``text`` with its line breaks folded into spaces, for one-line error messages."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def traceback_note(where: str, text: str) -> str:
    """The ``__notes__`` entry that shows a remote traceback (``where`` names its origin)."""
    return f"Remote traceback ({where}):\n{text.rstrip()}"


@dataclass(frozen=True)
class RemoteErrorInfo:
    """A failure on one rank, as plain data (see the module docstring for the format)."""

    rank: int | None
    stage: str
    step: int | None
    error_type: str
    module: str
    message: str
    traceback: str
    lineage: tuple[str, ...] = ()

    @classmethod
    def from_exception(
        cls, exc: BaseException, *, rank: int | None, stage: str, step: int | None
    ) -> RemoteErrorInfo:
        """Describe ``exc`` (raised on ``rank`` in ``stage`` at ``step``), within the bounds.
        A carried ``KeyboardInterrupt`` (or other ``BaseException``) is described as itself."""
        exc = unwrap(exc)
        kind = type(exc)
        lineage = tuple(_qualified(c) for c in kind.__mro__ if c is not object)
        return cls(
            rank=rank,
            stage=stage[:MAX_NAME_CHARS],
            step=step,
            error_type=kind.__qualname__[:MAX_NAME_CHARS],
            module=kind.__module__[:MAX_NAME_CHARS],
            message=_text_of(exc)[:MAX_MESSAGE_CHARS],
            traceback=_tail(_traceback_of(exc), MAX_TRACEBACK_CHARS),
            lineage=tuple(name[:MAX_NAME_CHARS] for name in lineage[:MAX_LINEAGE]),
        )

    @property
    def qualified_type(self) -> str:
        """``module.type``, e.g. ``builtins.KeyError`` (just ``type`` when no module is known)."""
        return f"{self.module}.{self.error_type}" if self.module else self.error_type

    def derives_from(self, cls: type) -> bool:
        """Whether the remote exception was an instance of ``cls`` (matched by qualified name)."""
        return _qualified(cls) in self.lineage

    def summary(self) -> str:
        """``Type: message`` on one line."""
        return f"{self.error_type}: {one_line(self.message)}"

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": FORMAT_VERSION,
            "rank": self.rank,
            "stage": self.stage,
            "step": self.step,
            "type": self.error_type,
            "module": self.module,
            "message": self.message,
            "traceback": self.traceback,
            "lineage": list(self.lineage),
        }

    @classmethod
    def from_wire(cls, data: object, *, sender: str) -> RemoteErrorInfo:
        """Check a received description; ``sender`` (e.g. ``"rank 3"``) names it in errors."""

        def bad(what: str) -> WireFormatError:
            return WireFormatError(
                f"Malformed error report from {sender}: {what}. Every rank must run the same "
                "evenflow version; a garbled report points at the network or at memory."
            )

        if not isinstance(data, dict):
            raise bad(f"expected a mapping, but got {type(data).__name__} {data!r:.80}")
        if data.get("v") != FORMAT_VERSION:
            raise bad(f"field 'v' is {data.get('v')!r:.40}, expected {FORMAT_VERSION}")

        def text(name: str, limit: int) -> str:
            value = data.get(name)
            if not isinstance(value, str):
                raise bad(f"field {name!r} must be a string, but got {value!r:.80}")
            if len(value) > limit:
                raise bad(f"field {name!r} has {len(value)} characters, more than {limit}")
            return value

        def count(name: str) -> int | None:
            value = data.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(f"field {name!r} must be a non-negative integer, but got {value!r:.80}")
            return value

        lineage = data.get("lineage")
        if not isinstance(lineage, (list, tuple)) or len(lineage) > MAX_LINEAGE:
            raise bad(f"field 'lineage' must be a list of at most {MAX_LINEAGE} class names")
        if not all(isinstance(n, str) and len(n) <= MAX_NAME_CHARS for n in lineage):
            raise bad(f"field 'lineage' holds a non-string or over-long name: {lineage!r:.120}")
        name = text("type", MAX_NAME_CHARS)
        if not name:
            raise bad("field 'type' is empty")
        return cls(
            rank=count("rank"),
            stage=text("stage", MAX_NAME_CHARS),
            step=count("step"),
            error_type=name,
            module=text("module", MAX_NAME_CHARS),
            message=text("message", MAX_MESSAGE_CHARS),
            traceback=text("traceback", MAX_TRACEBACK_CHARS),
            lineage=tuple(lineage),
        )
