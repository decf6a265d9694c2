"""One-shot iterators as step sources: used once, never silently empty.

A generator or any other iterator can be read only once. Handed to a loader as its source, it
used to give **zero steps** without a word on the second pass (after ``set_epoch(1)``) or in a
second loader. The loader now wraps such a source in :class:`OneShotSource`, which

* refuses a second pass (``set_epoch`` after the first pass began, or a new pass) with a
  ``ConfigError`` that names the fix: a re-iterable (a list, a ``Dataset``, an object whose
  ``__iter__`` returns a fresh iterator) or a factory source such as
  ``IterableSource(lambda: my_generator())``;
* turns a first pass that yields no step at all (the iterator was exhausted or consumed
  elsewhere before the loader saw it) into the same kind of error instead of an empty pass;
* refuses an iterator that already feeds another loader in this process.

Everything else (``state_dict``, ``load_state_dict``, ``set_epoch``, ``len()``) is passed to the
wrapped iterator unchanged. Objects that rewind themselves (they have ``reset()``, as
``torchdata.nodes`` do) are not one-shot and are not wrapped.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from evenflow.engine.errors import ConfigError

__all__ = ["OneShotSource", "guard_one_shot"]

_FIX = (
    "pass a re-iterable (a list, a Dataset, or an object whose __iter__ returns a fresh "
    "iterator) or a factory source such as IterableSource(lambda: make_steps())"
)

# Iterators already handed to a loader in this process (weakly held: a finished run frees them).
_claimed: weakref.WeakSet[Any] = weakref.WeakSet()


def _describe(source: object) -> str:
    return f"{type(source).__name__} {source!r:.60}"


class OneShotSource:
    """A one-shot iterator as a source: iterated at most once, never silently empty."""

    def __init__(self, iterator: Iterator[Any] | AsyncIterator[Any]) -> None:
        self._iterator = iterator
        self._started = False

    @property
    def started(self) -> bool:
        """Whether a pass has begun reading the iterator."""
        return self._started

    def __getattr__(self, name: str) -> Any:
        # state_dict / load_state_dict / set_epoch / custom attributes of the wrapped iterator.
        return getattr(self._iterator, name)

    def __len__(self) -> int:
        return len(self._iterator)  # type: ignore[arg-type]

    def check_reusable(self, what: str) -> None:
        """Raise if a pass already read the iterator; ``what`` names the caller's action."""
        if self._started:
            raise ConfigError(
                f"{what} needs a new pass over the source, but the source is a one-shot "
                f"iterator ({_describe(self._iterator)}) that the first pass already consumed; "
                f"{_FIX}."
            )

    def _begin(self) -> None:
        self.check_reusable("Iterating the loader again")
        self._started = True

    def _empty(self) -> ConfigError:
        return ConfigError(
            f"The source is a one-shot iterator ({_describe(self._iterator)}) that yielded no "
            f"step: it was exhausted or consumed elsewhere before this loader read it; {_FIX}."
        )

    def __iter__(self) -> Iterator[Any]:
        if not isinstance(self._iterator, Iterator):
            raise TypeError(f"The source {_describe(self._iterator)} is an async iterator.")
        self._begin()
        return self._steps(self._iterator)

    def _steps(self, iterator: Iterator[Any]) -> Iterator[Any]:
        count = 0
        for step in iterator:
            count += 1
            yield step
        if count == 0:
            raise self._empty()


class OneShotAsyncSource(OneShotSource):
    """:class:`OneShotSource` for async iterators (the pipeline reads them with ``__aiter__``)."""

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(f"The source {_describe(self._iterator)} is an async iterator.")

    def __aiter__(self) -> AsyncIterator[Any]:
        self._begin()
        assert isinstance(self._iterator, AsyncIterator)
        return self._async_steps(self._iterator)

    async def _async_steps(self, iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
        count = 0
        async for step in iterator:
            count += 1
            yield step
        if count == 0:
            raise self._empty()


def guard_one_shot(source: Any) -> Any:
    """``source`` itself when it can be iterated again, else a one-shot guard around it."""
    if callable(getattr(source, "reset", None)):
        return source  # rewinds itself (torchdata nodes)
    if isinstance(source, AsyncIterator):
        guard: OneShotSource = OneShotAsyncSource(source)
    elif isinstance(source, Iterator):
        guard = OneShotSource(source)
    else:
        return source
    try:
        if source in _claimed:
            raise ConfigError(
                f"source is a one-shot iterator ({_describe(source)}) that already feeds "
                f"another loader, so this one would see only what is left of it; {_FIX}."
            )
        _claimed.add(source)
    except TypeError:  # not weakly referenceable (e.g. a list iterator): cannot be tracked
        pass
    return guard
