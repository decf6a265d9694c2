"""``LoaderConfig``: the frozen, validated settings of a :class:`BalancedLoader`.

Runtime objects (the transport, the device, callbacks) are constructor arguments of the loader,
never config fields: a config is plain data that can be compared, hashed into a fingerprint and
logged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from evenflow.engine._model import MAX_TOKENS, OversizedPolicy, PackingConstraints
from evenflow.engine._validate import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_int,
)
from evenflow.engine.errors import ConfigError

__all__ = ["LoaderConfig"]

PlanningMode = Literal["replicated", "leader"]
UnevenEnd = Literal["stop", "raise"]


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Settings of one balanced loader. Every field is validated at construction.

    Attributes:
        seq_len: token capacity of one packed sequence (bin).
        bins_per_rank: packed sequences (microbatches) per rank per step; every source step
            must hold exactly this many non-empty bins.
        prefetch_depth: steps prepared ahead of the one the caller holds. Step ``s`` is
            delivered only after the metadata round of step ``s + 1`` has confirmed that every
            rank finished ``s`` (fail-together), so at most ``prefetch_depth + 1`` undelivered
            steps are held in memory.
        device_prefetch_depth: how many prepared, undelivered steps may sit on the training
            device (``None``: as many as are prepared, up to ``prefetch_depth + 1``). The
            other prepared steps wait on the host, pinned, and are copied as the caller takes
            earlier ones. At most ``prefetch_depth``. The loader's batches then take at most
            ``device_prefetch_depth + 1`` steps of device memory between ``next()`` calls
            (the caller's step included) and one more during ``next()`` while the loop still
            holds the previous batch (docs/reference/config.md has the arithmetic). Only
            meaningful with a device.
        min_balance_gain: a re-balanced layout is used only when it lowers the objective by
            strictly more than this fraction (``0.0`` = any strict improvement).
        objective: ``"makespan"`` (the slowest rank's cost: DDP, where a rank runs its
            microbatches without waiting for the others), ``"lockstep"`` (the sum over
            microbatch positions of the slowest rank there, every rank's bins delivered
            costliest first: FSDP, pipeline schedules, tensor parallelism across the
            data-parallel group, where ranks synchronise at every microbatch) or ``"balance"``
            (squared coefficient of variation of rank costs).
        balance: ``False`` keeps every source layout (same pipeline, no movement); useful as a
            baseline.
        oversized_policy: ``"error"`` rejects samples longer than ``seq_len``; ``"single"`` lets
            one occupy a bin alone.
        packing_budgets: named per-bin hard limits matched against
            ``SampleMetadata.packing_costs``.
        planning: ``"replicated"`` plans on every rank (no broadcast; plan digests are
            cross-checked) or ``"leader"`` plans on group rank 0 and broadcasts the layout.
        timeout: seconds a collective may wait for peers (used when the loader creates its own
            transport, and as the bound on every internal wait).
        max_steps: stop after this many steps (``None`` = until the source ends).
        on_uneven_end: when one rank's source ends before the others', ``"stop"`` ends
            iteration on every rank at the same step; ``"raise"`` raises
            ``SourceExhaustedError`` on every rank.
        switch_interval: seconds for ``sys.setswitchinterval`` while the loader runs, lowered
            only (never raised) when the loader starts; ``None`` leaves the interpreter alone.
            The pipeline's pure-Python stage work runs on background threads; with Python's
            default 5 ms interval every GIL hand-off back to the training thread can wait that
            long, which shows up as data stall in sync iteration (``evenflow bench pipeline``
            measured the 0.5 ms default passing every target where 5 ms missed three). It is a
            process-wide setting: the value the process had is restored when the last open
            loader that lowered it is closed (unless something else changed it meanwhile).
        balance_window: consecutive steps planned together (the balance window). ``1`` plans
            each step on its own. With ``W > 1`` the steps ``[k*W, (k+1)*W)`` of a pass are
            read (one metadata round each, as always), planned together once the last one is
            gathered, and delivered in order; a sample may train in another step of its
            window than the one it was read in (never outside it: its delay is ``< W``), so
            a step's outliers can meet other steps' outliers side by side on different ranks.
            The window's first step cannot be delivered before its last is read, so at most
            ``balance_window + prefetch_depth`` steps are read and not yet delivered.
        thread_nice: added to the niceness (Linux scheduling priority, 0-19) of every thread
            the loader starts: its event-loop thread in sync iteration and its CPU, source and
            read pools. ``0`` leaves them alone. On a host with no core to spare, a positive
            value lets the training thread's compute win the CPU: the pipeline works
            ``prefetch_depth`` steps ahead and can wait, compute cannot (``evenflow demo``,
            2 ranks on 2 cores, uses 19). The transport's collective thread keeps its
            priority (peers wait on it). A no-op off Linux and where the OS refuses.
        close_timeout: seconds ``close()`` waits for the threads the loader started to finish
            what they run. A thread still inside user code then (a ``read()`` stuck on a
            network filesystem, a ``pack_fn`` that never returns) is abandoned: it is a daemon
            thread, so it never keeps the process from exiting, and a WARNING on the
            ``"evenflow"`` logger names it and what it runs. ``close()`` itself returns within
            about this many seconds, plus at most 5 s for each transport it closes (a
            collective still in flight).
        log_stats: log one line of balance statistics per step on group rank 0 (logger
            ``"evenflow"``, INFO; shown on standard error when the application configured no
            logging, see :mod:`evenflow.engine._logging`).
    """

    seq_len: int
    bins_per_rank: int
    prefetch_depth: int = 2
    device_prefetch_depth: int | None = None
    min_balance_gain: float = 0.0
    objective: Literal["makespan", "lockstep", "balance"] = "makespan"
    balance: bool = True
    oversized_policy: OversizedPolicy = "error"
    packing_budgets: Mapping[str, float] | None = field(default=None, hash=False)
    planning: PlanningMode = "replicated"
    timeout: float = 300.0
    max_steps: int | None = None
    on_uneven_end: UnevenEnd = "stop"
    switch_interval: float | None = 0.0005
    balance_window: int = 1
    thread_nice: int = 0
    close_timeout: float = 10.0
    log_stats: bool = True

    def __new__(cls, *args: Any, **kwargs: Any) -> LoaderConfig:
        # The generated __init__ is keyword-only; Python's own message for positional
        # arguments names neither the fields nor the fix.
        if args:
            names = [f.name for f in dataclasses.fields(cls)]
            shown = ", ".join(f"{n}={v!r}" for n, v in zip(names, args, strict=False))
            raise ConfigError(
                f"LoaderConfig takes keyword arguments only, but got {len(args)} positional "
                f"({', '.join(map(repr, args))}). Name them: LoaderConfig({shown})."
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        check_int(
            "LoaderConfig.seq_len",
            self.seq_len,
            minimum=1,
            maximum=MAX_TOKENS,
            why="positions are int32 in packed layouts",
        )
        check_int("LoaderConfig.bins_per_rank", self.bins_per_rank, minimum=1)
        check_int("LoaderConfig.prefetch_depth", self.prefetch_depth, minimum=1)
        check_optional_int(
            "LoaderConfig.device_prefetch_depth", self.device_prefetch_depth, minimum=1
        )
        if (
            self.device_prefetch_depth is not None
            and self.device_prefetch_depth > self.prefetch_depth
        ):
            raise ConfigError(
                f"LoaderConfig.device_prefetch_depth must be at most prefetch_depth="
                f"{self.prefetch_depth} (steps on the device are prepared steps), but got "
                f"{self.device_prefetch_depth!r}; lower it or raise prefetch_depth."
            )
        gain = check_number(
            "LoaderConfig.min_balance_gain",
            self.min_balance_gain,
            minimum=0.0,
            maximum=1.0,
            strict_maximum=True,
        )
        object.__setattr__(self, "min_balance_gain", gain)
        check_choice("LoaderConfig.objective", self.objective, ("makespan", "lockstep", "balance"))
        check_bool("LoaderConfig.balance", self.balance)
        check_choice("LoaderConfig.planning", self.planning, ("replicated", "leader"))
        timeout = check_number(
            "LoaderConfig.timeout", self.timeout, minimum=0.0, strict_minimum=True
        )
        object.__setattr__(self, "timeout", timeout)
        check_optional_int("LoaderConfig.max_steps", self.max_steps, minimum=1)
        check_choice("LoaderConfig.on_uneven_end", self.on_uneven_end, ("stop", "raise"))
        if self.switch_interval is not None:
            interval = check_number(
                "LoaderConfig.switch_interval",
                self.switch_interval,
                minimum=0.0,
                strict_minimum=True,
                maximum=1.0,
            )
            object.__setattr__(self, "switch_interval", interval)
        check_int("LoaderConfig.balance_window", self.balance_window, minimum=1)
        if check_int("LoaderConfig.thread_nice", self.thread_nice) > 19:
            raise ConfigError(
                f"LoaderConfig.thread_nice must be at most 19 (the lowest priority), but got "
                f"{self.thread_nice!r}; pass 0 to leave the loader's threads alone, or 1-19."
            )
        close_timeout = check_number(
            "LoaderConfig.close_timeout", self.close_timeout, minimum=0.0, strict_minimum=False
        )
        object.__setattr__(self, "close_timeout", close_timeout)
        check_bool("LoaderConfig.log_stats", self.log_stats)
        # Validates seq_len, oversized_policy and packing_budgets with one set of messages.
        constraints = PackingConstraints(
            seq_len=self.seq_len,
            oversized_policy=self.oversized_policy,
            packing_budgets=self.packing_budgets,
        )
        object.__setattr__(self, "packing_budgets", dict(constraints.budgets) or None)

    @property
    def constraints(self) -> PackingConstraints:
        return PackingConstraints(
            seq_len=self.seq_len,
            oversized_policy=self.oversized_policy,
            packing_budgets=self.packing_budgets,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (for fingerprints, checkpoints and logs)."""
        data = dataclasses.asdict(self)
        if data["packing_budgets"] is not None:
            data["packing_budgets"] = dict(sorted(data["packing_budgets"].items()))
        return data
