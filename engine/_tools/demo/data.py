"""The demo's training text: the Python standard library's own sources, one function a document.

Nothing is downloaded: every Python installation carries its standard library, and every rank
of a demo reads the same files, so the ranks build the same dataset without talking to each
other (``DatasetSource`` checks that their lengths agree). Tokens are bytes (a vocabulary of
256), so the tokenizer is ``numpy.frombuffer``.

A *document* is one function, method, class header or module header: a file is cut before
every top-level or one-indent ``def``/``class``/decorator, and a piece longer than
``seq_len`` is cut into ``seq_len``-long parts. That gives the long-tailed lengths of a real
corpus of code (a few dozen bytes for a one-line helper, thousands for a long method; the
median is about 240 bytes, the 99th percentile about 3,300), the shape that makes packed steps
cost unequal amounts once attention's ``L²`` matters.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from evenflow.engine._validate import check_int
from evenflow.engine.errors import ConfigError

__all__ = ["VOCAB_SIZE", "corpus_files", "documents", "stdlib_dataset"]

VOCAB_SIZE = 256
"""Byte-level tokens."""

# Cut before a top-level or one-indent def, class or decorator (and the ``__main__`` guard).
_CUT = re.compile(rb"\n(?=(?:    )?(?:async def |def |class |@)|if __name__)")


def corpus_files(seed: int) -> list[Path]:
    """The standard library's ``.py`` files (no site-packages), in a seeded order."""
    check_int("seed", seed, minimum=0)
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages"))
        found.extend(Path(folder) / f for f in sorted(files) if f.endswith(".py"))
    order = np.random.default_rng(seed).permutation(len(found))
    return [found[i] for i in order]


def documents(files: Sequence[Path], seq_len: int) -> Iterator[npt.NDArray[np.int32]]:
    """Byte-token documents of ``files``, each at most ``seq_len`` long (see the module doc)."""
    check_int("seq_len", seq_len, minimum=2)
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:  # an unreadable file is not part of the corpus
            continue
        for block in _CUT.split(data):
            tokens = np.frombuffer(block, dtype=np.uint8).astype(np.int32)
            for start in range(0, len(tokens), seq_len):
                piece = tokens[start : start + seq_len]
                if len(piece) >= 2:  # a one-token document trains on nothing
                    yield piece


def stdlib_dataset(*, seq_len: int, num_tokens: int, seed: int) -> list[dict[str, Any]]:
    """A map-style dataset of at least ``num_tokens`` tokens: ``[{"input_ids": array}, ...]``.

    Deterministic for a given installation and ``seed``: files are read in a seeded order
    until the documents hold ``num_tokens`` tokens. Raises ``ConfigError`` when the whole
    standard library holds fewer (ask for fewer steps, ranks or a shorter ``seq_len``).
    """
    check_int("num_tokens", num_tokens, minimum=1)
    dataset: list[dict[str, Any]] = []
    total = 0
    for doc in documents(corpus_files(seed), seq_len):
        dataset.append({"input_ids": doc})
        total += len(doc)
        if total >= num_tokens:
            return dataset
    raise ConfigError(
        f"The standard library holds {total:,} tokens of documents, fewer than the "
        f"{num_tokens:,} this run needs; lower --steps, --ranks, --bins-per-rank or --seq-len."
    )
