"""``evenflow bench trainer``: evenflow against ``BatchRebalanceSampler`` in the HF ``Trainer``.

The same Hugging Face ``Trainer`` trains the same tiny Llama (random weights, built from a
config) on the same long-tailed dataset, on 2 local Gloo ranks, one epoch per configuration,
fed three ways:

* ``random``: the Trainer's default sampler; microbatches of ``--batch`` samples padded to
  their longest;
* ``batch_rebalance``: ``train_sampling_strategy="batch_rebalance"``, transformers'
  ``BatchRebalanceSampler`` (in transformers 5.24): each optimizer step's samples (the same
  count as ``random``) sorted by length and cut into groups of near-equal *padded* cost
  (``bs * max_len + 0.001 * bs * max_len^2``), dealt to ranks slot by slot; padded
  microbatches;
* ``evenflow``: ``EvenflowTrainer``: samples packed into bins of ``--seq-len`` tokens with no
  padding, each optimizer step's samples re-assigned across ranks by the FLOPs cost model of
  the model's config.

Figures, all from one run: real (non-padding) tokens trained per second by the world; the
share of padding in the tokens computed; and the rank compute imbalance: per optimizer step,
the slowest rank's compute over the mean rank's (compute = CPU time of the training thread in
forward and backward, one intra-op thread per rank), averaged over the steps. One target:
evenflow's imbalance is below ``random``'s.

What each balances: ``BatchRebalanceSampler`` minimises padding and evens out each
microbatch's padded cost across ranks, with a fixed number of samples per step; evenflow
packs without padding and evens out each rank's predicted compute of the step, keeping the
samples of the step. Limits: a CPU with a tiny model, so the attention term is smaller than on
long contexts on a GPU; timings on a shared 2-core machine vary by several percent.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from evenflow.engine._tools.bench._verdict import add_report_only, targets_status
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError
from evenflow.transports.launch import LaunchError, run_ranks

__all__ = ["main"]

_MODES = ("random", "batch_rebalance", "evenflow")
_VOCAB = 256
_ACCUMULATION = 2


def _lengths(num: int, seq_len: int, seed: int) -> list[int]:
    """A long-tailed mix: most samples short, a few near ``seq_len`` (log-normal)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=4.2, sigma=0.9, size=num)
    return [int(v) for v in np.clip(raw, 8, seq_len)]


def _dataset(spec: dict[str, Any]) -> Any:
    import datasets
    import torch

    gen = torch.Generator().manual_seed(spec["seed"])
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for n in _lengths(spec["samples"], spec["seq_len"], spec["seed"]):
        ids = torch.randint(1, _VOCAB, (n,), generator=gen).tolist()
        rows["input_ids"].append(ids)
        rows["labels"].append(ids)
    return datasets.Dataset.from_dict(rows)


def _model(seq_len: int) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _pad(features: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad a microbatch to its longest sample (labels -100 and attention 0 on padding)."""
    import torch

    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _warm_up(seq_len: int) -> None:
    """One forward and backward per shape class before timing: the first run in a process
    pays one-time costs (kernel selection, allocator growth) that would land on whichever
    configuration ran first."""
    import torch

    model = _model(seq_len)
    for n in (64, 256, 1024):
        ids = torch.randint(0, _VOCAB, (1, min(n, seq_len)))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


class _Meter:
    """Per optimizer step: the training thread's CPU time in forward and backward; over the
    run: the real (non-padding) and computed tokens."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.cpu = 0.0
        self.real = 0
        self.computed = 0

    def timed(self, base: Any) -> Any:
        meter = self

        class Timed(base):  # type: ignore[misc]
            def training_step(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
                start = time.thread_time()
                loss = super().training_step(model, inputs, *args, **kw)
                meter.cpu += time.thread_time() - start
                ids = inputs["input_ids"]
                mask = inputs.get("attention_mask")
                meter.computed += int(ids.numel())
                meter.real += int(ids.numel() if mask is None else mask.sum())
                return loss

        return Timed

    def callback(self) -> Any:
        import transformers

        meter = self

        class StepCpu(transformers.TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                meter.steps.append(meter.cpu)
                meter.cpu = 0.0

        return StepCpu()


def _train(mode: str, spec: dict[str, Any], data: Any, meter: _Meter) -> float:
    """Train one epoch with ``mode``; return the Trainer's ``train_runtime``."""
    import importlib

    import torch.distributed as dist
    import transformers

    # By name: the adapter imports transformers, which the benchmark's module must not need
    # at import time (the CLI lists every benchmark without their dependencies).
    hf = importlib.import_module("evenflow.engine.integrations.hf")
    with tempfile.TemporaryDirectory() as folder:
        common: dict[str, Any] = {
            "output_dir": folder,
            "gradient_accumulation_steps": _ACCUMULATION,
            "num_train_epochs": 1,
            "learning_rate": 1e-3,
            "optim": "sgd",
            "report_to": [],
            "disable_tqdm": True,
            "save_strategy": "no",
            "logging_strategy": "no",
            "use_cpu": True,
            "seed": spec["seed"],
            "ddp_find_unused_parameters": False,
        }
        extra: dict[str, Any] = {}
        if mode == "evenflow":
            args = transformers.TrainingArguments(per_device_train_batch_size=1, **common)
            trainer_class = meter.timed(hf.EvenflowTrainer)
            extra["seq_len"] = spec["bin_len"]
        else:
            args = transformers.TrainingArguments(
                per_device_train_batch_size=spec["batch"],
                train_sampling_strategy=mode if mode == "batch_rebalance" else "random",
                remove_unused_columns=False,
                **common,
            )
            trainer_class = meter.timed(transformers.Trainer)
            extra["data_collator"] = _pad
        trainer = trainer_class(
            model=_model(spec["seq_len"]),
            args=args,
            train_dataset=data,
            callbacks=[meter.callback()],
            **extra,
        )
        dist.barrier()
        result = trainer.train()
    return float(result.metrics["train_runtime"])


def _bench_rank(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    import logging

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    data = _dataset(spec)
    _warm_up(spec["seq_len"])
    out: dict[str, Any] = {}
    for mode in spec["modes"]:
        meter = _Meter()
        runtime = _train(mode, spec, data, meter)
        steps = torch.tensor(meter.steps, dtype=torch.float64)
        gathered = [torch.zeros_like(steps) for _ in range(num_ranks)]
        dist.all_gather(gathered, steps)
        per_rank = torch.stack(gathered)  # ranks x steps
        counts = torch.tensor([meter.real, meter.computed], dtype=torch.float64)
        dist.all_reduce(counts)
        out[mode] = {
            "steps": int(per_rank.shape[1]),
            "runtime_s": runtime,
            "real_tokens": int(counts[0]),
            "computed_tokens": int(counts[1]),
            "real_tokens_per_s": float(counts[0]) / runtime,
            "padding_share": 1.0 - float(counts[0] / counts[1]),
            "imbalance": float((per_rank.max(0).values / per_rank.mean(0)).mean()),
            "step_cpu_max_s": float(per_rank.max(0).values.mean()),
        }
    return out


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="evenflow against transformers' BatchRebalanceSampler and random batching "
        "in the Hugging Face Trainer, on 2 local Gloo ranks (see the module docstring).",
    )
    parser.add_argument("--quick", action="store_true", help="a small dataset (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--samples", type=int, default=None, help="dataset size (default 1200; --quick 160)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=1024, help="longest sample and evenflow's bin size"
    )
    parser.add_argument(
        "--bin-len",
        type=int,
        default=None,
        help="tokens per evenflow packed bin (default --seq-len)",
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="samples per padded microbatch (default 8)"
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    parser.add_argument(
        "--deadline", type=float, default=900.0, help="seconds for the whole run (default 900)"
    )
    add_report_only(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "evenflow bench trainer") -> int:
    """Run the comparison; 0 when its target passed, 1 on a MISS (unless ``--report-only``)
    or a failure, 2 on bad input."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    samples = args.samples if args.samples is not None else (160 if args.quick else 1200)
    try:
        check_int("--samples", samples, minimum=32)
        check_int("--seq-len", args.seq_len, minimum=64)
        check_int("--batch", args.batch, minimum=1)
        bin_len = check_int(
            "--bin-len", args.seq_len if args.bin_len is None else args.bin_len, minimum=64
        )
        if bin_len < args.seq_len:
            raise ConfigError(
                f"--bin-len={bin_len} is shorter than --seq-len={args.seq_len}, the longest "
                "sample; a bin must hold it. Raise --bin-len or lower --seq-len."
            )
        check_int("--seed", args.seed, minimum=0)
        check_number("--deadline", args.deadline, minimum=0.0, strict_minimum=True)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        import transformers.trainer_pt_utils as pt_utils
    except ImportError:
        print(f"{prog}: error: needs transformers (pip install '.[test]').", file=sys.stderr)
        return 1
    if not hasattr(pt_utils, "BatchRebalanceSampler"):
        print(
            f"{prog}: error: this transformers ({transformers_version()}) has no "
            "BatchRebalanceSampler; install transformers 5.24.",
            file=sys.stderr,
        )
        return 1
    spec = {
        "samples": samples,
        "seq_len": args.seq_len,
        "bin_len": bin_len,
        "batch": args.batch,
        "seed": args.seed,
        "modes": list(_MODES),
    }
    started = time.perf_counter()
    print(f"{prog}: 2 ranks, {samples} samples, 3 configurations ...", file=sys.stderr)
    try:
        ranks = run_ranks(
            _bench_rank,
            2,
            args=[spec],
            deadline=args.deadline,
            timeout=120.0,
            env={"OMP_NUM_THREADS": "1"},
        )
    except LaunchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    cases = ranks[0]
    lengths = _lengths(samples, args.seq_len, args.seed)
    doc: dict[str, Any] = {
        "benchmark": "trainer",
        "config": {
            **{k: v for k, v in spec.items() if k != "modes"},
            "ranks": 2,
            "gradient_accumulation_steps": _ACCUMULATION,
            "transformers": transformers_version(),
            "mean_length": sum(lengths) / len(lengths),
            "max_length": max(lengths),
        },
        "cases": cases,
        "wall_s": time.perf_counter() - started,
    }
    ours, random_ = cases["evenflow"]["imbalance"], cases["random"]["imbalance"]
    doc["targets"] = [
        {
            "name": "evenflow's rank compute imbalance is below random batching's",
            "value": ours,
            "limit": random_,
            "status": "PASS" if ours < random_ else "MISS",
        }
    ]
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_text(doc)
    return targets_status(doc["targets"], report_only=args.report_only, prog=prog)


def transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "not installed"
    return str(transformers.__version__)


def _print_text(doc: dict[str, Any]) -> None:
    config = doc["config"]
    print(
        f"evenflow bench trainer: 2 Gloo ranks, {config['samples']} samples (mean length "
        f"{config['mean_length']:.0f}, longest {config['max_length']}), "
        f"{config['gradient_accumulation_steps']} microbatches per step, transformers "
        f"{config['transformers']}"
    )
    header = (
        f"{'configuration':<16}{'steps':>6}{'real tok/s':>12}{'vs random':>10}"
        f"{'padding':>9}{'max/mean rank compute':>23}{'slowest rank s/step':>21}"
    )
    print(header)
    base = doc["cases"]["random"]["real_tokens_per_s"]
    for mode, case in doc["cases"].items():
        print(
            f"{mode:<16}{case['steps']:>6}{case['real_tokens_per_s']:>12.0f}"
            f"{case['real_tokens_per_s'] / base:>9.2f}x{case['padding_share']:>8.1%}"
            f"{case['imbalance']:>23.3f}{case['step_cpu_max_s']:>21.3f}"
        )
    for target in doc["targets"]:
        print(
            f"{target['status']}  {target['name']}: {target['value']:.3f} vs {target['limit']:.3f}"
        )
    print(f"wall time {doc['wall_s']:.0f} s")
