"""Spawn N torch.distributed ranks on this machine (public path of the testing wing's launcher).

The implementation lives in :mod:`evenflow.transports.testing.launch`; this module keeps the
documented import path ``evenflow.transports.launch``.
"""

from __future__ import annotations

from evenflow.transports.testing.launch import (
    LaunchError,
    RankDeadlineError,
    RankFailedError,
    RankPool,
    run_ranks,
)

__all__ = ["LaunchError", "RankDeadlineError", "RankFailedError", "RankPool", "run_ranks"]
