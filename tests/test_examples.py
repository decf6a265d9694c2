"""Every script in ``examples/`` runs, with tiny settings, under a deadline.

Each example is run as its users run it (a fresh ``python`` process, or ``torchrun`` for the
DDP example) and its output is checked for what the example claims to show.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEADLINE_S = 120.0  # generous: a 2-core machine running other tests is slow to import torch


def _run(args: list[str], cwd: Path) -> str:
    """Run ``args``; return stdout, failing with the combined output on a non-zero exit."""
    try:
        done = subprocess.run(
            args, cwd=cwd, capture_output=True, text=True, timeout=DEADLINE_S, check=False
        )
    except subprocess.TimeoutExpired as exc:  # subprocess.run killed the child
        output = f"{exc.stdout!r}\n{exc.stderr!r}"
        pytest.fail(f"{args} did not finish within {DEADLINE_S:g} s:\n{output}")
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _example(name: str, *options: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / name), *options]


def test_every_example_is_tested() -> None:
    tested = {
        "ddp_sync_torchrun.py",
        "async_loop_with_hooks.py",
        "custom_transport.py",
        "tracing_perfetto.py",
        "resume_checkpoint.py",
        "elastic_resume.py",
        "parallel_tokenize.py",
        "hf_training_loop.py",
        "hf_trainer.py",
        "accelerate_loop.py",
        "lightning_module.py",
        "torchtitan_loader.py",
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.multiprocess
def test_ddp_sync_torchrun(tmp_path: Path) -> None:
    out = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "ddp_sync_torchrun.py"),
            "--steps",
            "3",
        ],
        tmp_path,
    )
    lines = re.findall(r"step (\d+): loss [\d.]+, max cost (\S+) -> (\S+), moved (\d+)", out)
    assert [int(step) for step, *_ in lines] == [0, 1, 2], out
    for _, before, after, moved in lines:
        # Rank 0 reads the long samples: balancing lowers the slowest rank's cost.
        assert float(after) < float(before) and int(moved) > 0, out


def _loop_block(text: str, start: str, end: str) -> str:
    begin = text.index(start) + len(start)
    return text[begin : text.index(end, begin)]


def test_readme_loop_is_the_hf_example_loop() -> None:
    example = (EXAMPLES / "hf_training_loop.py").read_text()
    region = textwrap.dedent(
        _loop_block(example, "# -- the loop (README.md shows this block as it is) --\n", "    # --")
    )
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = _loop_block(readme, "## In your training loop", "\n## ")
    fenced = _loop_block(section, "```python illustrative\n", "```")
    assert fenced.endswith(region), "README.md's loop differs from examples/hf_training_loop.py"
    for must in (
        "use_cache=False",
        "num_items_in_batch=tokens.world",
        'os.environ["RANK"]',
        "DatasetSource(",
    ):
        assert must in region


@pytest.mark.multiprocess
def test_hf_training_loop(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "hf_training_loop.py"),
            "--steps",
            "3",
        ],
        tmp_path,
    )
    pattern = (
        r"step (\d+): loss ([\d.]+) over (\d+) loss tokens \(this rank (\d+)\), "
        r"max cost (\S+) -> (\S+), moved (\d+)"
    )
    lines = re.findall(pattern, out)
    assert [int(line[0]) for line in lines] == [0, 1, 2], out
    for _, loss, world, mine, before, after, _moved in lines:
        # A random-weight model over 256 tokens: the mean token loss is about ln(256) = 5.55.
        assert 4.5 < float(loss) < 6.5, out
        assert 0 < int(mine) < int(world), out
        assert float(after) <= float(before), out  # never worse than the source
    assert any(int(line[-1]) > 0 for line in lines), out  # balancing moved samples


def test_async_loop_with_hooks(tmp_path: Path) -> None:
    out = _run(_example("async_loop_with_hooks.py", "--steps", "3"), tmp_path)
    steps = re.findall(r"rank (\d) step (\d): trains \d+ tokens; slowest rank (\S+) -> (\S+),", out)
    assert sorted((int(r), int(s)) for r, s, *_ in steps) == [
        (r, s) for r in (0, 1) for s in (0, 1, 2)
    ]
    assert all(float(after) < float(before) for *_, before, after in steps), out
    assert len(re.findall(r"rank \d: waited [\d.]+ ms for data, computed [\d.]+ ms", out)) == 2


def test_custom_transport(tmp_path: Path) -> None:
    out = _run(_example("custom_transport.py", "--steps", "2"), tmp_path)
    assert "CountingTransport passed check_transport on 2 ranks" in out
    counts = {
        int(rank): (int(sent), int(received))
        for rank, sent, received in re.findall(
            r"rank (\d): 2 steps, sent (\d+) bytes, received (\d+) bytes", out
        )
    }
    assert set(counts) == {0, 1}, out
    # With two ranks, what one sends is what the other receives.
    assert counts[0][0] == counts[1][1] > 0 and counts[1][0] == counts[0][1] > 0
    # Rank 0 holds the long samples, so it sends more than it receives.
    assert counts[0][0] > counts[0][1]


def test_tracing_perfetto(tmp_path: Path) -> None:
    out = _run(
        _example("tracing_perfetto.py", "--out", str(tmp_path / "traces"), "--steps", "3"),
        tmp_path,
    )
    merged = json.loads((tmp_path / "traces" / "merged.json").read_text())
    spans = [e for e in merged["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    stages = {e["name"] for e in spans}
    assert {"read", "gather", "plan", "exchange", "pack", "wait", "compute"} <= stages
    for rank in (0, 1):
        jsonl = (tmp_path / "traces" / f"trace-rank{rank}.jsonl").read_text().splitlines()
        assert {json.loads(line)["rank"] for line in jsonl} == {rank}
    for stage in ("read", "gather", "plan", "exchange", "pack", "wait", "compute"):
        assert re.search(rf"^  {stage}\s+\d+", out, re.MULTILINE), out
    assert "rank 0 data stall:" in out


def test_resume_checkpoint(tmp_path: Path) -> None:
    out = _run(
        _example(
            "resume_checkpoint.py", "--out", str(tmp_path), "--steps", "4", "--stop-after", "2"
        ),
        tmp_path,
    )
    for mode in ("stateful", "stateless"):
        assert (
            f"{mode}: stopped after 2 of 4 steps, resumed; batches equal to the uninterrupted "
            "run on every rank: True"
        ) in out
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]


@pytest.mark.multiprocess
def test_parallel_tokenize(tmp_path: Path) -> None:
    out = _run(
        _example("parallel_tokenize.py", "--texts", "400", "--stop-after", "3", "--workers", "2"),
        tmp_path,
    )
    for mode in ("workers", "threads"):
        steps = re.findall(rf"{mode}: rank (\d) trained (\d+) steps \((\d+) tokens\), (\d+) ", out)
        assert sorted(int(r) for r, *_ in steps) == [0, 1], out
        assert len({int(n) for _, n, *_ in steps}) == 1 and int(steps[0][1]) > 3, out
        assert (
            f"{mode}: restored the checkpoint of step 3; the rest equals the run on every rank: "
            "True"
        ) in out
    # Workers and threads tokenize the same texts: the same steps come out.
    workers = re.findall(r"workers: rank \d trained (.*)", out)
    threads = re.findall(r"threads: rank \d trained (.*)", out)
    assert workers == threads


@pytest.mark.multiprocess
def test_elastic_resume(tmp_path: Path) -> None:
    out = _run(_example("elastic_resume.py", "--out", "ckpt", "--samples", "160"), tmp_path)
    resumed = re.search(r"2 ranks resumed at step (\d+)", out)
    assert resumed is not None and resumed.group(1) == "3", out
    epoch = re.search(
        r"epoch 0: (\d+) of 160 samples delivered, (\d+) twice; (\d+) never delivered, "
        r"the documented remainder is (\d+)",
        out,
    )
    assert epoch is not None, out
    delivered, twice, never, remainder = map(int, epoch.groups())
    assert twice == 0 and never == remainder and delivered + never == 160, out
    steps = re.search(r"epoch 1: (\d+) steps per rank, as a 2-rank run: (\d+)", out)
    assert steps is not None and steps.group(1) == steps.group(2), out


# -- the framework adapters' examples ---------------------------------------------------------

#: example -> the how-to that shows its marked block
_HOWTOS = {
    "hf_trainer.py": "hf-trainer.md",
    "accelerate_loop.py": "accelerate.md",
    "lightning_module.py": "lightning.md",
    "torchtitan_loader.py": "torchtitan.md",
}


@pytest.mark.parametrize("name", sorted(_HOWTOS))
def test_howto_block_is_the_examples_block(name: str) -> None:
    """Each framework how-to shows its example's marked block as it is (and runs it through
    the example's test below)."""
    example = (EXAMPLES / name).read_text()
    page = _HOWTOS[name]
    start = f"# -- evenflow (docs/howto/{page} shows this block as it is) --\n"
    text = (EXAMPLES.parent / "docs" / "howto" / page).read_text()
    blocks = re.findall(r"```python illustrative\n(.*?)```", text, re.DOTALL)
    regions = example.split(start)[1:]
    assert regions, f"examples/{name} marks no block for docs/howto/{page}"
    for rest in regions:
        region = textwrap.dedent(rest[: rest.index("# --\n")]).rstrip() + "\n"
        assert region in blocks, f"docs/howto/{page} does not show a block of examples/{name}"
        if name == "hf_trainer.py":  # the promise: a Trainer user adds evenflow in <= 15 lines
            assert len(region.strip().splitlines()) <= 15


def _torchrun(name: str, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / name),
        *options,
    ]


_ADAPTER_ENV = {"OMP_NUM_THREADS": "1"}


def _run_env(args: list[str], cwd: Path) -> str:
    env = {**os.environ, **_ADAPTER_ENV}
    try:
        done = subprocess.run(
            args,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args} did not finish within {DEADLINE_S:g} s:\n{exc.stdout!r}")
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


_STEP = re.compile(r"step (\d+): loss ([\d.]+).*max cost (\S+) -> (\S+), moved (\d+)")


def _steps(out: str) -> list[tuple[str, ...]]:
    return _STEP.findall(out)


@pytest.mark.multiprocess
def test_hf_trainer_trains_two_epochs_and_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    args = _torchrun("hf_trainer.py", "--samples", "120", "--save-steps", "4")
    steps = _steps(_run_env(args, tmp_path))
    # 120 samples: 3 balanced steps per epoch on 2 ranks, 2 epochs.
    assert [int(s[0]) for s in steps] == [1, 2, 3, 4, 5, 6], steps
    assert any(int(s[-1]) > 0 for s in steps), steps  # the plan moved samples
    assert all(float(after) <= float(before) for _, _, before, after, _ in steps)
    folder = tmp_path / "evenflow-trainer"
    assert {p.name for p in (folder / "checkpoint-4").glob("evenflow-loader-*")} == {
        "evenflow-loader-rank0.pt",
        "evenflow-loader-rank1.pt",
    }
    shutil.rmtree(folder / "checkpoint-6")  # resume from step 4, inside the second epoch
    resumed = _steps(_run_env([*args, "--resume"], tmp_path))
    assert resumed == steps[4:]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "package"),
    [
        ("accelerate_loop.py", "accelerate"),
        ("lightning_module.py", "lightning"),
        ("torchtitan_loader.py", "torch"),
    ],
)
def test_framework_example_trains_balanced_steps(name: str, package: str, tmp_path: Path) -> None:
    pytest.importorskip(package)
    steps = _steps(_run_env(_torchrun(name, "--samples", "120"), tmp_path))
    assert len(steps) in (6, 8), steps  # two epochs of 3 steps (torchtitan: 8 steps)
    for _, loss, before, after, _ in steps:
        assert 4.5 < float(loss) < 6.5  # ln(256) = 5.55 for the random-weight model
        assert float(after) <= float(before)
    assert any(int(s[-1]) > 0 for s in steps), steps
