"""The rank side of ``evenflow demo``: one data-parallel rank training every arm in turn.

Each rank (a process spawned by ``run_ranks``, the default process group being the training
group) builds the dataset (:mod:`.data`), the model and the cost model (:mod:`.calibrate`),
then one :class:`_Arm` per configuration to compare: balancing off, balanced step by step, and
balanced over a window of steps when the loader offers one. The arms train the same steps from
the same initial weights, taking turns one step at a time, so a machine whose speed drifts
(other jobs, thermal limits) slows every arm alike; each arm's loader keeps prefetching while
the others train.

A training step is the recipe of the documentation: every bin's *summed* token loss divided by
the loss tokens of the whole world for that step, backward bin by bin, one all-reduce (sum) of
the gradients, an AdamW step. Balancing moves samples between ranks and bins, so a per-rank
mean would weight tokens by where the plan put them; the world's total does not depend on the
plan, so every arm computes the same loss on the same samples. The world's loss tokens come
from one small all-reduce of each rank's count before the forward pass.

Everything the parent needs comes back as plain data; ``phase_file`` (written by rank 0) tells
the parent what the ranks were doing if the deadline passes.
"""

from __future__ import annotations

import copy
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._planning.cost import QuadraticCost, TokenCost
from evenflow.engine._planning.flops import FlopsCost
from evenflow.engine._sources.dataset import DatasetSource
from evenflow.engine._tools.demo.calibrate import FittedCost, calibration_bins, time_bins
from evenflow.engine._tools.demo.data import VOCAB_SIZE, stdlib_dataset
from evenflow.engine._tools.demo.model import TinyCausalLM, TinyConfig, packed_loss
from evenflow.engine._tracing import Tracer
from evenflow.transports import GlooTransport

__all__ = ["ARM_LABELS", "rank_main"]

#: What each arm is called in the report, in the order the arms train.
ARM_LABELS = {"off": "balancing off", "step": "balanced per step", "window": "balance window"}


def _phase(spec: dict[str, Any], rank: int, text: str) -> None:
    """Record what rank 0 is doing, for the parent's deadline message and for the reader."""
    if rank != 0:
        return
    Path(spec["phase_file"]).write_text(f"{time.time()}\n{text}\n", encoding="utf-8")
    if not spec["tty"]:
        print(f"  {text}", file=sys.stderr, flush=True)


def _dataset(spec: dict[str, Any], rank: int, num_ranks: int) -> tuple[list[Any], Any]:
    """The dataset (the same on every rank) and its lengths; enough for ``steps`` steps."""
    import numpy as np

    need = spec["steps"] * num_ranks * spec["bins_per_rank"] * spec["seq_len"]
    factor = 1.25
    while True:  # first-fit packing leaves bins partly empty: read more until the steps fit
        data = stdlib_dataset(
            seq_len=spec["seq_len"], num_tokens=int(need * factor), seed=spec["seed"]
        )
        lengths = np.fromiter((len(d["input_ids"]) for d in data), dtype=np.int64)
        if len(_source(spec, data, lengths, rank, num_ranks)) >= spec["steps"]:
            return data, lengths
        factor *= 1.25


def _source(
    spec: dict[str, Any], data: list[Any], lengths: Any, rank: int, num_ranks: int
) -> DatasetSource:
    return DatasetSource(
        data,
        seq_len=spec["seq_len"],
        bins_per_rank=spec["bins_per_rank"],
        rank=rank,
        num_ranks=num_ranks,
        lengths=lengths,
        seed=spec["seed"],
    )


def _cost_model(spec: dict[str, Any], model: TinyCausalLM) -> tuple[Any, dict[str, Any]]:
    name = spec["cost_model"]
    if name == "tokens":
        return TokenCost(), {"name": "tokens", "formula": "L"}
    if name == "quadratic":
        quadratic = QuadraticCost()
        formula = f"{quadratic.linear:g}·L + {quadratic.quadratic:g}·L²"
        return quadratic, {"name": "quadratic", "formula": formula}
    if name == "flops":
        hf = model.config.hf_config()
        return FlopsCost(hf), {"name": "flops", "formula": "FLOPs of the model"}
    import torch
    import torch.distributed as dist

    bins = calibration_bins(spec["seq_len"])
    started = time.perf_counter()
    local = torch.tensor(time_bins(model, bins, repeats=3), dtype=torch.float64)
    dist.all_reduce(local)  # the training group: every rank fits the same numbers
    seconds = (local / dist.get_world_size()).tolist()
    fitted = FittedCost.fit(bins, seconds)
    detail: dict[str, Any] = {
        "name": "calibrated",
        "formula": fitted.describe(),
        "coefficients": fitted.as_dict(),
        "bins": [[len(b), b[0]] for b in bins],
        "seconds": seconds,
        "calibration_s": time.perf_counter() - started,
        "online": True,
    }
    # The loaders start from the start-up fit and keep fitting what training measures.
    return fitted.calibrated(), detail


class _Arm:
    """One configuration's model copy, optimizer, loader and tracer, trained step by step."""

    def __init__(
        self, spec: dict[str, Any], name: str, rank: int, num_ranks: int, parts: dict[str, Any]
    ) -> None:
        import torch

        self.name, self.rank, self.num_ranks = name, rank, num_ranks
        self.model = copy.deepcopy(parts["model"])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=spec["lr"], weight_decay=0.0)
        self.cost_model = parts["cost_model"]
        # Each arm moves its data on a Gloo group of its own; every rank creates the groups
        # in the same order, as new_group requires.
        self.transport = GlooTransport(timeout=spec["timeout"])
        self.tracer = Tracer(chrome=Path(spec["out"]) / "traces" / name)
        options: dict[str, Any] = {"balance": name != "off"}
        if name == "window":
            options["balance_window"] = spec["window"]
        config = LoaderConfig(
            seq_len=spec["seq_len"],
            bins_per_rank=spec["bins_per_rank"],
            max_steps=spec["steps"],
            timeout=spec["timeout"],
            log_stats=False,
            # Two ranks share two cores with three arms' pipelines: the pipelines work ahead
            # and can wait for a core, the training step cannot.
            thread_nice=spec.get("thread_nice", 0),
            **options,
        )
        source = _source(spec, parts["data"], parts["lengths"], rank, num_ranks)
        self.loader = BalancedLoader(
            source,
            config=config,
            metadata_fn=source.metadata_fn,
            transport=self.transport,
            cost_model=parts["cost_model"],
            algorithm=spec["algorithm"],
            tracer=self.tracer,
        )
        self.calibrates = self.loader.calibration_stats is not None
        self.iterator = iter(self.loader)
        self.steps: list[dict[str, Any]] = []
        self.stats: list[dict[str, Any]] = []

    def train_step(self) -> bool:
        """Fetch and train one step; False when the loader has no more steps."""
        import torch
        import torch.distributed as dist

        step = len(self.steps)
        started, started_unix = time.perf_counter(), time.time()
        batch = next(self.iterator, None)
        if batch is None:
            return False
        # The world's loss tokens for this step, the same on every rank whatever the plan:
        # the loader counted them in its metadata round. The gradient all-reduce below sums,
        # so the divide factor is 1.
        totals = self.loader.last_loss_tokens
        assert totals is not None, "the default pack_fn always counts loss tokens"
        scale = totals.loss_scale(1.0)
        t1, cpu1 = time.perf_counter(), time.thread_time()
        loss_sum, tokens, samples, bins = 0.0, 0, 0, []
        for packed in batch:
            b0 = time.thread_time()
            cu = packed["cu_seq_lens_q"]
            logits = self.model(packed["input_ids"], packed["position_ids"], cu)
            loss, _ = packed_loss(logits, packed["labels"])
            (loss * scale).backward()
            loss_sum += float(loss.item())
            lengths = torch.diff(cu).tolist()
            bins.append([lengths, time.thread_time() - b0])
            if self.calibrates:
                self.loader.record_compute(bins[-1][1], bin=len(bins) - 1)
            tokens += int(packed["input_ids"].numel())
            samples += len(lengths)
        t2, cpu2 = time.perf_counter(), time.thread_time()
        # DDP-style: one flat all-reduce (sum: every rank's loss was already divided by the
        # world's tokens) of every gradient and of the loss sum. It also waits for the
        # slowest rank, which is what balancing shortens.
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([*(g.reshape(-1) for g in grads), torch.tensor([loss_sum])])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        t3 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        self.tracer.add("train/forward+backward", step, t1, t2)
        self.tracer.add("train/all-reduce", step, t2, t3)
        self.tracer.add("train/optimizer", step, t3, t4)
        self.steps.append(
            {
                "step": step,
                "start_unix": started_unix,
                "step_s": t4 - started,
                "wait_s": t1 - started,
                "compute_s": t2 - t1,
                "compute_cpu_s": cpu2 - cpu1,
                "sync_s": t3 - t2,
                "optimizer_s": t4 - t3,
                "loss": float(flat[-1].item()) * scale,  # the world's mean token loss
                "loss_tokens": totals.world,
                "tokens": tokens,
                "samples": samples,
                "bins": bins,
            }
        )
        if self.loader.last_stats is not None and self.rank == 0:
            self.stats.append(self.loader.last_stats.to_dict())
        return True

    def close(self) -> dict[str, Any]:
        """Close the loader (writes this rank's Chrome trace) and return the arm's record."""
        import asyncio

        calibration = self.loader.calibration_stats if self.steps else None
        try:
            self.loader.close()
        finally:
            asyncio.run(self.transport.aclose())
        return {
            "steps": self.steps,
            "stats": self.stats,
            "chrome": str(self.tracer.chrome_path) if self.tracer.chrome_path else None,
            "calibration": None
            if calibration is None
            else {
                "coefficients": list(calibration.coefficients),
                "median_error": calibration.median_error,
                "p90_error": calibration.p90_error,
                "num_accepted": calibration.num_accepted,
            },
        }


def _progress(spec: dict[str, Any], arms: dict[str, _Arm]) -> None:
    total = spec["steps"]
    done = min(len(arm.steps) for arm in arms.values())
    times = ", ".join(
        f"{ARM_LABELS[name]} {arm.steps[-1]['step_s']:.2f} s"
        for name, arm in arms.items()
        if arm.steps
    )
    loss = arms["off"].steps[-1]["loss"] if arms["off"].steps else float("nan")
    if spec["tty"]:
        width = 24
        bar = "#" * round(width * done / total) + "-" * (width - round(width * done / total))
        end = "\n" if done == total else ""
        sys.stderr.write(f"\r  [{bar}] step {done}/{total}: {times}; loss {loss:.2f}{end}")
    else:  # a log file gets one line per step, never a redrawn bar
        sys.stderr.write(f"  step {done}/{total}: {times}; loss {loss:.2f}\n")
    sys.stderr.flush()


def rank_main(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Body of one rank (a spawned process; the arguments and the result are plain data)."""
    import torch

    torch.set_num_threads(spec["threads_per_rank"])
    torch.manual_seed(spec["seed"])  # the same initial weights on every rank, as DDP needs
    _phase(spec, rank, "reading the standard library's sources into a dataset ...")
    data, lengths = _dataset(spec, rank, num_ranks)
    config = TinyConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec["hidden_size"],
        num_layers=spec["layers"],
        num_heads=spec["heads"],
        intermediate_size=3 * spec["hidden_size"],
        max_positions=spec["seq_len"],
    )
    model = TinyCausalLM(config)
    _phase(spec, rank, "timing the model on every rank to calibrate the cost model ...")
    cost_model, cost_detail = _cost_model(spec, model)
    parts = {"model": model, "cost_model": cost_model, "data": data, "lengths": lengths}
    arms: dict[str, _Arm] = {}
    records: dict[str, Any] = {}
    _phase(spec, rank, f"training {spec['steps']} steps of each arm, taking turns ...")
    try:
        for name in spec["arms"]:
            arms[name] = _Arm(spec, name, rank, num_ranks, parts)
        # Every rank stops at the same step: the loaders end together (on_uneven_end="stop").
        # The arms take turns in a rotating order, so that none is always the one that trains
        # right after the others' loaders prefetched (or while they still do).
        order = list(arms.values())
        for round_ in itertools.count():
            turn = order[round_ % len(order) :] + order[: round_ % len(order)]
            if not all([arm.train_step() for arm in turn]):
                break
            if rank == 0:
                _progress(spec, arms)
                done = min(len(arm.steps) for arm in arms.values())
                Path(spec["phase_file"]).write_text(
                    f"{time.time()}\ntraining: step {done} of {spec['steps']} done\n",
                    encoding="utf-8",
                )
    finally:
        for name, arm in arms.items():
            records[name] = arm.close()
    _phase(spec, rank, "writing the report ...")
    return {
        "rank": rank,
        "arms": records,
        "cost_model": cost_detail,
        "parameters": sum(p.numel() for p in model.parameters()),
        "documents": len(data),
    }
