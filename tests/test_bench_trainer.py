"""``evenflow bench trainer``: argument checks (a run trains three Trainers on 2 ranks for about
a minute, so the suite does not run it; docs/benchmarks.md has its figures)."""

from __future__ import annotations

import pytest

from evenflow.engine._tools import cli
from evenflow.engine._tools.bench.trainer import _lengths, _pad, main


def test_bad_arguments_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--samples", "4"]) == 2
    assert "--samples" in capsys.readouterr().err
    assert main(["--seq-len", "512", "--bin-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "--bin-len=256" in err and "--seq-len=512" in err
    assert main(["--batch", "0"]) == 2
    assert main(["--deadline", "0"]) == 2


def test_it_is_a_command() -> None:
    assert cli.main(["bench", "trainer", "--help"]) == 0


def test_the_mix_is_long_tailed_and_the_padding_is_masked() -> None:
    lengths = _lengths(1000, 1024, 0)
    assert min(lengths) >= 8 and max(lengths) == 1024
    mean = sum(lengths) / len(lengths)
    assert mean < 150 < max(lengths) / 4  # mostly short, a few long
    batch = _pad([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
