"""What a newcomer meets first: errors that point the right way, and step statistics that are
visible without any logging set-up."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine.errors import ConfigError


def test_positional_config_arguments_are_named_in_the_error() -> None:
    with pytest.raises(ConfigError) as info:
        LoaderConfig(4096, 4)  # type: ignore[misc]
    text = str(info.value)
    assert "keyword arguments only" in text
    assert "LoaderConfig(seq_len=4096, bins_per_rank=4)" in text
    assert LoaderConfig(seq_len=4096, bins_per_rank=4).seq_len == 4096


def test_a_step_of_samples_instead_of_bins_is_named_as_such() -> None:
    # Two samples (lists of token ids) where two bins of samples were expected.
    steps = [[[5, 6, 7], [8, 9]]]
    config = LoaderConfig(seq_len=16, bins_per_rank=2, log_stats=False)
    with pytest.raises(ConfigError) as info, BalancedLoader(steps, config=config) as loader:
        list(loader)
    text = str(info.value)
    assert "A sample is the number 5" in text and "one nesting level short" in text
    assert "metadata_fn" not in text


def test_step_statistics_are_visible_without_logging_configuration() -> None:
    script = textwrap.dedent(
        """
        from evenflow.engine import BalancedLoader, LoaderConfig
        config = LoaderConfig(seq_len=8, bins_per_rank=2)
        with BalancedLoader([[[[1, 2]], [[3]]]] * 2, config=config) as loader:
            n = len(list(loader))
        print("steps", n)
        """
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "steps 2" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("evenflow: step ")]
    assert len(lines) == 2, out.stderr


def test_configured_logging_gets_each_line_once() -> None:
    script = textwrap.dedent(
        """
        import logging
        from evenflow.engine import BalancedLoader, LoaderConfig
        config = LoaderConfig(seq_len=8, bins_per_rank=2)
        with BalancedLoader([[[[1, 2]], [[3]]]] * 2, config=config) as loader:
            next(iter(loader))
            logging.basicConfig(level=logging.INFO, format="app: %(message)s")
            list(loader)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    own = [ln for ln in out.stderr.splitlines() if ln.startswith("evenflow: step ")]
    app = [ln for ln in out.stderr.splitlines() if ln.startswith("app: step ")]
    # Step 0 is shown by the default handler; once the application configures logging, its
    # handler shows the rest and the default one steps aside.
    assert len(own) == 1 and len(app) == 1, out.stderr


def test_bench_alone_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    from evenflow.engine._tools import cli

    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "usage: evenflow bench <benchmark>" in err and "nothing" not in err
    assert all(name in err for name in ("planner", "exchange", "pipeline", "scale"))
    assert cli.main(["bench", "--help"]) == 0
    assert "usage: evenflow bench <benchmark>" in capsys.readouterr().out
    assert cli.main(["bench", "plannr"]) == 2
    assert "unknown benchmark 'plannr'" in capsys.readouterr().err


def test_every_option_of_every_command_has_help_text(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from evenflow.engine._tools import cli

    seen: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    commands = [["demo"], *(["bench", name] for name in cli._BENCHMARKS)]
    for command in commands:
        with contextlib.suppress(SystemExit):
            cli.main(command)
    assert len(seen) == len(commands)
    for command, parser in zip(commands, seen, strict=True):
        bare = [
            "/".join(a.option_strings)
            for a in parser._actions
            if a.option_strings and not a.help and a.help is not argparse.SUPPRESS
        ]
        assert not bare, f"evenflow {' '.join(command)}: options without help: {bare}"
