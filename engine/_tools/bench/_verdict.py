"""What a benchmark's exit status says about its targets.

Every benchmark prints its targets as PASS / MISS lines. A run whose targets were missed exits
with status 1, so that scripts and CI notice; ``--report-only`` keeps the report and exits 0
(for a loaded machine, or to collect figures without judging them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["add_report_only", "targets_status"]


def add_report_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="exit 0 even when a target line says MISS (report the figures, do not judge them)",
    )


def targets_status(targets: Iterable[Mapping[str, Any]], *, report_only: bool, prog: str) -> int:
    """0 when no target was missed (or ``report_only``), else 1, saying which on stderr."""
    missed = [str(t.get("name", "?")) for t in targets if t.get("status") == "MISS"]
    if not missed:
        return 0
    if report_only:
        print(f"{prog}: {len(missed)} target(s) missed (--report-only: exit 0).", file=sys.stderr)
        return 0
    print(
        f"{prog}: {len(missed)} target(s) missed: {'; '.join(missed)}. Exit status 1; pass "
        "--report-only to report without judging.",
        file=sys.stderr,
    )
    return 1
