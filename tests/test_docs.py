"""The documentation is executable and complete.

* Every fenced ``python`` block of every Markdown file under ``docs/`` runs, in order, in one
  namespace per file (a page may build on its earlier blocks); a block whose info string is
  ``python illustrative`` is only compiled. Any other spelling of a Python block fails.
* The reference pages name every ``LoaderConfig`` field, every error class, every trace stage
  and summary key the engine really produces, and every option of every ``evenflow`` command.
* Relative links resolve, and the index links every page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
PYTHON_WORDS = {"python", "py", "python3", "py3", "pycon", "ipython"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of ``path`` (``` fences, info string kept)."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(.*)$", lines[i])
        if opening is None:
            i += 1
            continue
        indent, info = opening.group(1), opening.group(2).strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent) :])
            i += 1
        assert i < len(lines), f"{path}:{start + 1}: code fence is never closed"
        blocks.append(Block(path, start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [
        b
        for b in fenced_blocks(path)
        if b.info.split()[:1] and b.info.split()[0].lower() in PYTHON_WORDS
    ]


def _page_id(path: Path) -> str:
    return str(path.relative_to(DOCS))


@contextlib.contextmanager
def _isolated_globals() -> Iterator[None]:
    """Undo what doc code may change globally: transport registrations, logger levels."""
    from evenflow.transports import _registry

    registered = dict(_registry._registered)
    loggers = {name: logging.getLogger(name).level for name in ("", "evenflow", "evenflow.trace")}
    try:
        yield
    finally:
        with _registry._lock:
            _registry._registered.clear()
            _registry._registered.update(registered)
        for name, level in loggers.items():
            logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks may write files (traces, checkpoints)
    # A real module, so that classes defined in a page (dataclasses included) resolve it.
    module = types.ModuleType(f"_docs_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    with _isolated_globals(), contextlib.redirect_stdout(io.StringIO()):
        for block in python_blocks(page):
            assert block.info in ("python", "python illustrative"), (
                f"{block.where}: a Python block must be ```python (it is run) or "
                f"```python illustrative (only compiled), not ```{block.info}"
            )
            code = compile(block.code, block.where, "exec")
            if block.info == "python":
                exec(code, namespace)


def test_docs_have_runnable_blocks() -> None:
    run = [b for p in PAGES for b in python_blocks(p) if b.info == "python"]
    pages = {b.path.name for b in run}
    assert len(run) >= 15, [b.where for b in run]
    for name in (
        "config.md",
        "loader.md",
        "errors.md",
        "tracing.md",
        "resume.md",
        "write-a-transport.md",
        "write-a-cost-model.md",
        "write-a-balancing-algorithm.md",
    ):
        assert name in pages, f"{name} has no runnable Python block"


def test_block_parser_sees_fences(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n\n```python illustrative\nnot run\n```\n"
        "  ```console\n  $ ls\n  ```\n",
        encoding="utf-8",
    )
    blocks = fenced_blocks(page)
    assert [(b.line, b.info, b.code) for b in blocks] == [
        (2, "python", "x = 1\n"),
        (6, "python illustrative", "not run\n"),
        (9, "console", "$ ls\n"),
    ]


# -- completeness of the reference -------------------------------------------------------


def _text(relative: str) -> str:
    return (DOCS / relative).read_text(encoding="utf-8")


def test_config_reference_lists_every_field() -> None:
    from evenflow.engine import LoaderConfig

    text = _text("reference/config.md")
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.MULTILINE))
    assert rows == {f.name for f in dataclasses.fields(LoaderConfig)}


def test_errors_reference_lists_every_error() -> None:
    from evenflow.engine import errors
    from evenflow.transports import launch

    text = _text("reference/errors.md")
    documented = set(re.findall(r"^\| `(\w+)` \|", text, re.MULTILINE))
    expected = set(errors.__all__) | {"LaunchError", "RankFailedError", "RankDeadlineError"}
    assert all(issubclass(getattr(launch, n), Exception) for n in expected if hasattr(launch, n))
    assert documented == expected


def test_tracing_reference_lists_every_stage_and_key() -> None:
    from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig, Tracer

    tracer = Tracer()
    config = LoaderConfig(seq_len=8, bins_per_rank=2, log_stats=False)
    with BalancedLoader([[[[1, 2]], [[3]]]] * 2, config=config, tracer=tracer) as loader:
        for _ in loader:
            pass
    summary = loader.trace_summary()
    # Shared-dataset mode replaces the exchange stage by the read of assigned samples.
    shared_tracer = Tracer()
    source = DatasetSource(
        [[1] * n for n in (3, 5, 2, 4, 6)], seq_len=8, bins_per_rank=2, shared=True
    )
    with BalancedLoader(source, config=config, tracer=shared_tracer) as loader:
        for _ in loader:
            pass
    text = _text("reference/tracing.md")
    stages = set(
        re.findall(r"^\| `(\w+)` \|", text.split("## Stages")[1].split("##")[0], re.MULTILINE)
    )
    # "world" and "h2d" appear only with several balance groups and with a device.
    assert stages == set(summary["stages"]) | set(loader.trace_summary()["stages"]) | {
        "world",
        "h2d",
    }
    keys = set(summary) | set(summary["caller"]) | set(next(iter(summary["stages"].values())))
    section = text.split("## Summary keys")[1]
    missing = sorted(key for key in keys if not re.search(rf"\b{key}\b", section))
    assert not missing, f"summary keys not described: {missing}"


_COMMANDS = (
    ["demo"],
    ["bench", "planner"],
    ["bench", "exchange"],
    ["bench", "pipeline"],
    ["bench", "scale"],
    ["bench", "calibration"],
    ["bench", "trainer"],
    ["bench", "transforms"],
)


@pytest.mark.parametrize("command", _COMMANDS, ids=" ".join)
def test_cli_reference_lists_every_option(command: list[str]) -> None:
    from evenflow.engine._tools import cli as _cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            status: object = _cli.main([*command, "--help"])
        except SystemExit as exc:  # argparse exits after printing the help
            status = exc.code
    assert status in (0, None), out.getvalue()
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.getvalue())) - {"--help"}
    assert options, out.getvalue()
    section = _text("reference/cli.md").split(f"## `evenflow {' '.join(command)}`")[1]
    section = section.split("\n## ")[0]
    missing = sorted(o for o in options if f"`{o}" not in section)
    assert not missing, f"evenflow {' '.join(command)}: undocumented options {missing}"


def test_the_command_runs_as_a_module_too() -> None:
    """The CLI reference promises ``python -m evenflow.engine`` beside the installed script."""
    done = subprocess.run(
        [sys.executable, "-m", "evenflow.engine", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: evenflow <command>" in done.stdout
    assert "python -m evenflow.engine" in _text("reference/cli.md")


def test_benchmarks_page_has_a_section_per_benchmark() -> None:
    text = _text("benchmarks.md")
    for name in (
        "planner",
        "exchange",
        "pipeline",
        "scale",
        "calibration",
        "trainer",
        "transforms",
    ):
        heading = re.search(rf"^## {name.capitalize()}\b.*$", text, re.MULTILINE)
        assert heading, f"no section for {name}"
        section = text[heading.end() :].split("\n## ")[0]
        assert f"$ evenflow bench {name}" in section
        assert "TBD" in section or re.search(r"\d", section)


# -- links ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_index_links_every_page() -> None:
    text = _text("index.md")
    linked = {
        (DOCS / target).resolve()
        for target in re.findall(r"\]\(([^)\s#]+)\)", text)
        if not re.match(r"^[a-z]+:", target)
    }
    for page in PAGES:
        if page.name != "index.md":
            assert page.resolve() in linked, f"index.md does not link {page.relative_to(DOCS)}"
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert example.resolve() in linked, f"index.md does not link {example.name}"
