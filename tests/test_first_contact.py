"""What a newcomer meets first: errors that point the right way, and step statistics that are
visible without any logging set-up."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
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


@pytest.mark.parametrize(
    ("bin_0", "expected"),
    [
        ([[1, 2, 3], [4, 5]], "holds 5 tokens in 2 sample(s), more than seq_len=4"),
        ([[1, 2, 3, 4, 5, 6]], "holds 6 tokens in 1 sample(s), more than seq_len=4"),
    ],
)
def test_an_overfull_source_bin_is_named_by_its_step_and_bin(
    bin_0: list[list[int]], expected: str
) -> None:
    steps = [[[[7]], [[8]]], [bin_0, [[3]]]]
    config = LoaderConfig(seq_len=4, bins_per_rank=2, log_stats=False)
    with pytest.raises(ConfigError) as info, BalancedLoader(steps, config=config) as loader:
        list(loader)
    text = str(info.value)
    assert text.startswith("Source step 1, bin 0 ") and expected in text
    assert "reference_bins" not in text
    fix = "pack each bin within seq_len" if len(bin_0) > 1 else "oversized_policy='single'"
    assert fix in text


def test_a_source_bin_over_a_packing_budget_is_named_by_its_step_and_bin() -> None:
    from evenflow.engine import SampleMetadata

    steps = [
        [
            [{"input_ids": [1], "cost": 2.0}, {"input_ids": [2], "cost": 2.0}],
            [{"input_ids": [3], "cost": 1.0}],
        ]
    ]
    config = LoaderConfig(seq_len=8, bins_per_rank=2, packing_budgets={"mem": 3.0}, log_stats=False)

    def describe(sample: dict[str, object]) -> SampleMetadata:
        return SampleMetadata(tokens=1, packing_costs={"mem": sample["cost"]})  # type: ignore[dict-item]

    with (
        pytest.raises(ConfigError) as info,
        BalancedLoader(steps, config=config, metadata_fn=describe) as loader,
    ):
        list(loader)
    text = str(info.value)
    assert "Source step 0, bin 0 has packing_costs['mem'] summing to 4.0" in text
    assert "packing_budgets['mem']=3.0" in text


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
    for name, parser in _parsers(monkeypatch).items():
        bare = [
            "/".join(a.option_strings)
            for a in parser._actions
            if a.option_strings and not a.help and a.help is not argparse.SUPPRESS
        ]
        assert not bare, f"evenflow {name}: options without help: {bare}"


def _parsers(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    """Every command's argument parser, captured as the command would parse its options."""
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
    return {" ".join(c): p for c, p in zip(commands, seen, strict=True)}


def test_list_options_take_space_separated_values_everywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsers = _parsers(monkeypatch)
    lists = {
        f"{name} {'/'.join(a.option_strings)}"
        for name, parser in parsers.items()
        for a in parser._actions
        if a.nargs in ("+", "*")
    }
    # The world sizes of every multi-world benchmark are one such list.
    for name in ("bench exchange", "bench pipeline", "bench planner", "bench scale"):
        assert f"{name} --ranks" in lists
    for name, parser in parsers.items():
        for a in parser._actions:
            assert "comma" not in (a.help or ""), f"{name} {a.option_strings}: {a.help}"


def test_a_comma_list_is_answered_with_the_space_separated_spelling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from evenflow.engine._tools.bench import exchange

    with pytest.raises(SystemExit) as info:
        exchange.main(["--ranks", "2,4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--ranks" in err and "write 2 4, not 2,4" in err


def test_bench_exchange_refuses_a_single_rank_and_sends_only_to_peers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from evenflow.engine._tools.bench import exchange

    with pytest.raises(SystemExit) as info:
        exchange.main(["--ranks", "1", "2"])
    assert info.value.code == 2
    assert "--ranks must all be >= 2" in capsys.readouterr().err
    # The engine never exchanges a sample with its own rank, so neither does the benchmark.
    for rank in range(3):
        outgoing, per_target = exchange._payload(rank, 3, 1 << 20, seed=0)
        assert outgoing[rank] == [] and per_target[rank] == 0
        assert all(outgoing[peer] for peer in range(3) if peer != rank)
        assert sum(per_target) >= (1 << 20) - 8


def test_the_cli_reference_states_the_no_skip_threshold_of_the_code() -> None:
    from pathlib import Path

    from evenflow.engine._tools.bench import planner

    text = (Path(__file__).parents[1] / "docs" / "reference" / "cli.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `--no-skip`"))
    stated = int(re.search(r"over ([\d,]+) bins", row).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert stated == planner._MAX_BINS


@pytest.mark.parametrize(("extra", "status"), [([], 1), (["--report-only"], 0)])
def test_bench_exchange_exits_1_on_a_missed_target_unless_report_only(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    status: int,
) -> None:
    from evenflow.engine._tools.bench import exchange

    row = {"num_ranks": 2, "mib_per_rank": 64, "vs_gather": 0.1, "vs_raw": 0.1, "vs_pickled": 1.0}
    monkeypatch.setattr(exchange, "run_ranks", lambda *a, **k: [])
    monkeypatch.setattr(exchange, "_summarize", lambda *a, **k: [row])
    monkeypatch.setattr(exchange, "_print_table", lambda *a, **k: None)
    argv = ["--ranks", "2", "--sizes-mib", "64", "--modes-steps", "0", *extra]
    assert exchange.main(argv) == status
    err = capsys.readouterr().err
    assert "1 target(s) missed" in err and ("--report-only" in err)
