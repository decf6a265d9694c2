"""The ``evenflow`` command: ``evenflow demo`` and ``evenflow bench <name>``.

Each subcommand lives in its own module with a ``main(argv) -> int`` and is imported only when
asked for, so ``evenflow --help`` stays instant and one broken benchmark cannot break the rest.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "evenflow.engine._tools.demo.run",
        "run N local ranks on Gloo and report balance and speedup",
    ),
}
_BENCHMARKS: dict[str, tuple[str, str]] = {
    "planner": ("evenflow.engine._tools.bench.planner", "plan quality and planning time"),
    "exchange": ("evenflow.engine._tools.bench.exchange", "payload exchange throughput on Gloo"),
    "pipeline": (
        "evenflow.engine._tools.bench.pipeline",
        "step time and data stall of the pipeline",
    ),
    "scale": ("evenflow.engine._tools.bench.scale", "planning and traffic at 8 to 1,024 ranks"),
    "calibration": (
        "evenflow.engine._tools.bench.calibration",
        "online cost-model calibration against a misspecified model",
    ),
    "trainer": (
        "evenflow.engine._tools.bench.trainer",
        "HF Trainer: evenflow vs BatchRebalanceSampler",
    ),
    "transforms": (
        "evenflow.engine._tools.bench.transforms",
        "heavy per-sample transforms: threads, worker processes, DataLoader",
    ),
}


def _usage() -> str:
    lines = ["usage: evenflow <command> [options]", "", "commands:"]
    for name, (_, text) in _COMMANDS.items():
        lines.append(f"  {name:<18}{text}")
    for name, (_, text) in _BENCHMARKS.items():
        lines.append(f"  bench {name:<12}{text}")
    lines.append("")
    lines.append("Run 'evenflow <command> --help' for the options of a command.")
    return "\n".join(lines)


def _bench_usage() -> str:
    lines = ["usage: evenflow bench <benchmark> [options]", "", "benchmarks:"]
    for name, (_, text) in _BENCHMARKS.items():
        lines.append(f"  {name:<12}{text}")
    lines.append("")
    lines.append("Run 'evenflow bench <benchmark> --help' for its options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] == "bench":
        if len(args) < 2 or args[1] in ("-h", "--help"):
            print(_bench_usage(), file=sys.stderr if len(args) < 2 else sys.stdout)
            return 2 if len(args) < 2 else 0
        if args[1] not in _BENCHMARKS:
            known = ", ".join(sorted(_BENCHMARKS))
            print(
                f"evenflow bench: unknown benchmark {args[1]!r}; choose one of: {known}.\n\n"
                f"{_bench_usage()}",
                file=sys.stderr,
            )
            return 2
        module_name, rest = _BENCHMARKS[args[1]][0], args[2:]
        prog = f"evenflow bench {args[1]}"
    elif args[0] in _COMMANDS:
        module_name, rest = _COMMANDS[args[0]][0], args[1:]
        prog = f"evenflow {args[0]}"
    else:
        print(f"evenflow: unknown command {args[0]!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(module_name)
    result: int = module.main(rest, prog=prog)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
