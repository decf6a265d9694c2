"""What the framework-adapter tests share: a tiny dataset and model, and how to read a run.

Everything is built from seeds on every rank (no download): a tokenized ``datasets.Dataset``
whose lengths are long-tailed (so packed steps are uneven and the plan moves samples), and a
tiny random-weight Llama built from a config with ``use_cache=False``. Every sample's tokens
are unique, so the samples a microbatch trains on are recovered from its packed row.
"""

from __future__ import annotations

import itertools
from typing import Any

VOCAB = 128
SEQ_LEN = 64
NUM_SAMPLES = 120
LR = 0.5


def one_thread() -> None:
    """One intra-op thread per rank: two ranks of two OpenMP threads each on a 2-core machine
    spin against each other (a tiny model's step went from ~0.1 s to over 1 s)."""
    import torch

    torch.set_num_threads(1)


def dataset(num_samples: int = NUM_SAMPLES) -> Any:
    """``input_ids`` and ``labels`` (every third sample masks a prompt out of the loss)."""
    import datasets
    import torch

    gen = torch.Generator().manual_seed(11)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    seen: set[tuple[int, ...]] = set()
    for i in range(num_samples):
        top = SEQ_LEN // 2 if i % 6 == 0 else SEQ_LEN // 6
        n = int(torch.randint(4, top, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        assert tuple(ids) not in seen
        seen.add(tuple(ids))
        prompt = n // 3 if i % 3 == 0 else 0
        rows["input_ids"].append(ids)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    return datasets.Dataset.from_dict(rows)


def sample_index(data: Any) -> dict[tuple[int, ...], int]:
    return {tuple(ids): i for i, ids in enumerate(data["input_ids"])}


def samples_of(microbatch: dict[str, Any], index: dict[tuple[int, ...], int]) -> list[int]:
    """The dataset indices packed in one microbatch row."""
    ids = microbatch["input_ids"][0].tolist()
    cu = microbatch["cu_seq_lens_q"].tolist()
    return [index[tuple(ids[a:b])] for a, b in itertools.pairwise(cu)]


def model() -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN * 2,
        use_cache=False,
    )
    torch.manual_seed(0)  # the same initial weights on every rank and every run
    return transformers.LlamaForCausalLM(config)


def params_bytes(module: Any) -> bytes:
    """Every parameter, in order, as float32 bytes (plain data for the launcher)."""
    import torch

    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in module.parameters()])
    return bytes(flat.numpy().tobytes())


def world_labels(microbatches: list[dict[str, Any]]) -> int:
    """The loss targets of a step in the whole world, counted from the labels themselves."""
    import torch
    import torch.distributed as dist

    mine = sum(int((mb["labels"][..., 1:] != -100).sum()) for mb in microbatches)
    total = torch.tensor(mine, dtype=torch.int64)
    dist.all_reduce(total)
    return int(total)


def relative_difference(a: bytes, b: bytes, start: bytes) -> float:
    """max |update_a - update_b| / max |update_b|, the updates taken from ``start``."""
    import numpy as np

    x, y, s = (np.frombuffer(v, dtype=np.float32).astype(np.float64) for v in (a, b, start))
    scale = float(np.abs(y - s).max())
    assert scale > 0, "training did not change the parameters"
    return float(np.abs((x - s) - (y - s)).max()) / scale
