"""Balancing never changes what the model learns: one training step of a real Hugging Face
causal LM (a tiny random-weight Llama built from a config, nothing downloaded) on two Gloo
processes, with balancing on and off.

With the documented recipe (each microbatch's summed token loss divided by the world's loss
tokens, times what the gradient reduction divides by) the parameter update is the same with
and without balancing, under DDP and under FSDP2 (``fully_shard`` on a CPU ``DeviceMesh``):
max relative difference ≤ 1e-5 in float32. The usual per-rank mean (``loss.mean()`` per
microbatch, averaged over microbatches and ranks) weights tokens by how many share their rank,
which the plan changes: its updates differ visibly, which is what lets these tests fail.

One pool of two processes serves the whole module (importing transformers dominates its cost).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "transformers",
    reason="transformers is not installed; install the test extra (pip install '.[test]')",
)

from evenflow.transports.launch import RankPool

TOLERANCE = 1e-5  # max relative difference of balanced vs unbalanced updates (float32)
VOCAB = 128
SEQ_LEN = 64
LR = 0.5


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=20.0, deadline=180.0) as ranks:
        yield ranks


def _steps(rank: int) -> list[list[list[dict[str, Any]]]]:
    """One step of two bins. Rank 0 reads a few long samples, rank 1 many short ones, so the
    plan moves samples; every other sample masks its prompt out of the loss."""
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    lengths = [[26, 30], [28, 24]] if rank == 0 else [[5, 7, 4, 6], [8, 3, 6, 5]]
    bins = []
    for i, sizes in enumerate(lengths):
        bin_ = []
        for j, n in enumerate(sizes):
            tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            if (i + j) % 2:
                prompt = n // 3
                bin_.append({"input_ids": tokens, "labels": [-100] * prompt + tokens[prompt:]})
            else:
                bin_.append({"input_ids": tokens})
        bins.append(bin_)
    return [bins]


def _model() -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        use_cache=False,
    )
    torch.manual_seed(0)  # the same initial weights on every rank and every run
    return transformers.LlamaForCausalLM(config)


def _one_step(rank: int, parallel: str, balance: bool, recipes: tuple[str, ...]) -> dict[str, Any]:
    """Load one step (balanced or not) and train it once per recipe from the same weights."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from evenflow.engine import LoaderConfig, build_loader

    world_size = dist.get_world_size()
    config = LoaderConfig(
        seq_len=SEQ_LEN, bins_per_rank=2, balance=balance, timeout=30.0, log_stats=False
    )
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    where = {"mesh": mesh} if parallel == "fsdp" else {"balance_group_size": world_size}
    with build_loader(_steps(rank), config, cost_model="quadratic", **where) as loader:
        batch = next(iter(loader))
        tokens, stats = loader.last_loss_tokens, loader.last_stats
    assert tokens is not None and stats is not None
    out: dict[str, Any] = {"moved": stats.num_moved, "tokens": tokens.to_dict(), "updates": {}}
    for recipe in recipes:
        model = _model()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if parallel == "ddp":
            wrapped: Any = DistributedDataParallel(model)
            divide_factor = float(world_size)  # DDP averages gradients over the world
        else:
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
            wrapped.set_gradient_divide_factor(1.0)  # FSDP2 then sums gradients
            # Gloo has no pre-multiplied sum; a plain sum (with a no-op scaling) it has.
            wrapped.set_force_sum_reduction_for_comms(True)
            divide_factor = 1.0
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
        for i, packed in enumerate(batch):
            last = i == len(batch) - 1
            sync = contextlib.nullcontext() if last or parallel != "ddp" else wrapped.no_sync()
            with sync:
                if recipe == "exact":
                    # The loss divides the microbatch's summed token loss by num_items_in_batch.
                    out_ = wrapped(**packed, use_cache=False, num_items_in_batch=tokens.world)
                    loss = out_.loss * divide_factor
                else:  # the per-rank mean most loops use
                    loss = wrapped(**packed, use_cache=False).loss / len(batch)
                loss.backward()
        optimizer.step()
        after = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in wrapped.named_parameters()
        }
        names = [n.removeprefix("module.") for n in after]
        out["updates"][recipe] = {
            n: after[k] - before[n] for n, k in zip(names, after, strict=True)
        }
    return out


def _rank_compare(rank: int, num_ranks: int, parallel: str) -> dict[str, Any]:
    """Relative difference of the balanced vs unbalanced update, per recipe, on this rank."""
    recipes = ("exact", "naive")
    on = _one_step(rank, parallel, True, recipes)
    off = _one_step(rank, parallel, False, recipes)
    result: dict[str, Any] = {"moved": on["moved"], "tokens_on": on["tokens"]}
    result["tokens_off"] = off["tokens"]
    for recipe in recipes:
        a, b = on["updates"][recipe], off["updates"][recipe]
        diff = max(float((a[n] - b[n]).abs().max()) for n in b)
        scale = max(float(b[n].abs().max()) for n in b)
        result[recipe] = diff / scale
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_balancing_leaves_the_parameter_update_unchanged(pool: RankPool, parallel: str) -> None:
    results = pool.run(_rank_compare, parallel, deadline=150.0)
    for r in results:
        on, off = r["tokens_on"], r["tokens_off"]
        assert r["moved"] > 0  # balancing did move samples ...
        assert on["rank"] != off["rank"]  # ... and changed what each rank trains on
        assert on["world"] == off["world"] == on["group"]  # one group: the world
        assert r["exact"] <= TOLERANCE, r
        assert r["naive"] > 100 * TOLERANCE, r  # the per-rank mean does depend on the plan
    # Replicated (DDP) or gathered (FSDP2) parameters: both ranks hold the same update.
    assert results[0]["exact"] == pytest.approx(results[1]["exact"], abs=1e-12)


def _rank_world(rank: int, num_ranks: int) -> dict[str, Any]:
    """Two balance groups of one rank each: the world total needs the world round."""
    from evenflow.engine import LoaderConfig, build_loader, count_loss_tokens

    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, timeout=30.0, log_stats=False)
    with build_loader(_steps(rank), config, balance_group_size=1) as loader:
        assert loader.transport is not None and loader.transport.num_ranks == 1
        batch = next(iter(loader))
        tokens = loader.last_loss_tokens
    assert tokens is not None
    return {"tokens": tokens.to_dict(), "counted": sum(count_loss_tokens(b) for b in batch)}


@pytest.mark.multiprocess
def test_the_world_round_sums_loss_tokens_across_balance_groups(pool: RankPool) -> None:
    results = pool.run(_rank_world, deadline=90.0)
    counted = [r["counted"] for r in results]
    for r, row in enumerate(results):
        assert row["tokens"] == {
            "step": 0,
            "rank": counted[r],
            "group": counted[r],
            "world": sum(counted),
        }
