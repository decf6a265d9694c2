"""Rank functions of the Accelerate, Lightning and torchtitan-protocol adapter tests.

``save_at`` > 0: checkpoint with the framework's own mechanism after that many optimizer
steps, and go on (the uninterrupted reference of the resumed run). ``resume``: continue from
that checkpoint.

Each trains the tiny Llama of :mod:`testkit.frameworks` with plain SGD and gradient
accumulation over 2 microbatches per step, and reports per optimizer step what each rank
trained, the loss divisor it used and the world's loss targets counted from the labels.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from testkit import frameworks as fw


def _unpack(run: dict[str, Any]) -> tuple[bool, int, int, bool]:
    """``run``: balance (bool), epochs, save_at (0: never), resume (bool)."""
    return bool(run["balance"]), int(run["epochs"]), int(run["save_at"]), bool(run["resume"])


def _config(balance: bool) -> Any:
    from evenflow.engine import LoaderConfig

    return LoaderConfig(
        seq_len=fw.SEQ_LEN, bins_per_rank=2, balance=balance, timeout=30.0, log_stats=False
    )


def accelerate_train(
    rank: int, num_ranks: int, out_dir: str, run: dict[str, Any]
) -> dict[str, Any]:
    balance, epochs, save_at, resume = _unpack(run)
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from evenflow.engine.integrations.accelerate import prepare_loader

    fw.one_thread()
    data = fw.dataset()
    index = fw.sample_index(data)
    record: dict[str, Any] = {"steps": [], "moved": [], "losses": []}
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = fw.model()
    record["start"] = fw.params_bytes(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=fw.LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    train = prepare_loader(
        accelerator,
        data,
        seed=3,
        loader_config=_config(balance),
        loader_kwargs={"cost_model": "quadratic"},
    )
    record["prepared_is_same"] = accelerator.prepare(train) is train
    checkpoint = os.path.join(out_dir, "accelerate")
    if resume:
        accelerator.load_state(checkpoint)
    done = 0
    with train:
        for epoch in range(train.start_epoch, epochs):
            train.set_epoch(epoch)
            step: list[dict[str, Any]] = []
            loss = torch.zeros(())
            for batch in train:
                with accelerator.accumulate(model):
                    out = model(**batch)
                    accelerator.backward(out.loss * train.loss_scale)
                    optimizer.step()
                    optimizer.zero_grad()
                step.append(batch)
                loss += out.loss.detach()
                if not accelerator.sync_gradients:
                    continue
                stats = train.loader.last_stats
                dist.all_reduce(loss)
                record["losses"].append(float(loss))
                record["moved"].append(0 if stats is None else int(stats.num_moved))
                record["steps"].append(
                    {
                        "epoch": epoch,
                        "samples": [fw.samples_of(mb, index) for mb in step],
                        "num_items": int(step[0]["num_items_in_batch"]),
                        "labels_world": fw.world_labels(step),
                        "loss_world": train.loader.last_loss_tokens.world,
                    }
                )
                step, loss = [], torch.zeros(())
                done += 1
                if save_at and done == save_at:
                    accelerator.save_state(checkpoint)
    record["params"] = fw.params_bytes(accelerator.unwrap_model(model))
    return record


def lightning_train(rank: int, num_ranks: int, out_dir: str, run: dict[str, Any]) -> dict[str, Any]:
    balance, epochs, save_at, resume = _unpack(run)
    import lightning
    import torch
    import torch.distributed as dist

    from evenflow.engine.integrations.lightning import EvenflowDataModule

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    fw.one_thread()
    data = fw.dataset()
    index = fw.sample_index(data)
    record: dict[str, Any] = {"steps": [], "moved": [], "losses": []}
    dm = EvenflowDataModule(
        data, seed=3, loader_config=_config(balance), loader_kwargs={"cost_model": "quadratic"}
    )

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = fw.model()
            self.pending: list[dict[str, Any]] = []
            self.loss = torch.zeros(())

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            out = self.model(**batch)
            self.pending.append(batch)
            self.loss += out.loss.detach()
            return out.loss * dm.loss_scale

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if len(self.pending) < 2:
                return
            step, self.pending = self.pending, []
            loss, self.loss = self.loss, torch.zeros(())
            dist.all_reduce(loss)
            assert dm.view is not None
            stats = dm.view.loader.last_stats
            record["losses"].append(float(loss))
            record["moved"].append(0 if stats is None else int(stats.num_moved))
            record["steps"].append(
                {
                    "epoch": self.current_epoch,
                    "samples": [fw.samples_of(mb, index) for mb in step],
                    "num_items": int(step[0]["num_items_in_batch"]),
                    "labels_world": fw.world_labels(step),
                    "loss_world": int(step[0]["num_items_in_batch"]),
                }
            )

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=fw.LR)

    module = Module()
    record["start"] = fw.params_bytes(module.model)
    folder = os.path.join(out_dir, "lightning")
    callbacks = []
    if save_at:
        # Lightning's own checkpointing, inside the run (as a run that is later killed).
        callbacks.append(
            lightning.pytorch.callbacks.ModelCheckpoint(
                dirpath=folder,
                filename="resume",
                every_n_train_steps=save_at,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=num_ranks,
        num_nodes=1,
        strategy="ddp",
        max_epochs=epochs,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=bool(save_at),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    checkpoint = os.path.join(folder, "resume.ckpt")
    trainer.fit(module, datamodule=dm, ckpt_path=checkpoint if resume else None)
    record["params"] = fw.params_bytes(module.model)
    return record


def titan_train(rank: int, num_ranks: int, out_dir: str, run: dict[str, Any]) -> dict[str, Any]:
    """A torchtitan-style loop: pull 2 microbatches per step, count the valid labels and sum
    them over the ranks (as torchtitan's trainer does), divide the summed token loss by that,
    and checkpoint the loader with torch.distributed.checkpoint under its per-rank keys."""
    balance, epochs, save_at, resume = _unpack(run)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel

    from evenflow.engine import DatasetSource, build_loader
    from evenflow.engine.integrations.torchtitan import TitanLoader

    fw.one_thread()
    data = fw.dataset()
    index = fw.sample_index(data)
    record: dict[str, Any] = {"steps": [], "moved": [], "losses": []}
    config = _config(balance)
    source = DatasetSource(
        data,
        seq_len=config.seq_len,
        bins_per_rank=2,
        rank=rank,
        num_ranks=num_ranks,
        seed=3,
        shared=True,
    )
    loader = build_loader(source, config, cost_model="quadratic")
    titan = TitanLoader(loader, dp_rank=rank, dp_world_size=num_ranks)
    model = fw.model()
    record["start"] = fw.params_bytes(model)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=fw.LR)
    checkpoint = os.path.join(out_dir, "titan")
    done, total = 0, epochs * len(source)
    if resume:
        state = {"dataloader": titan, "model": model.state_dict()}
        dcp.load(state, checkpoint_id=checkpoint)
        model.load_state_dict(state["model"])
        with open(checkpoint + ".json") as f:
            done = int(json.load(f)["done"])
    record["is_base_dataloader"] = _is_titan_base(titan)
    try:
        batches = iter(titan)
        while done < total:
            micro = [next(batches) for _ in range(2)]
            valid = torch.tensor(sum(int((labels != -100).sum()) for _, labels in micro))
            dist.all_reduce(valid)
            loss_sum = torch.zeros(())
            for i, (inputs, labels) in enumerate(micro):
                sync = i == len(micro) - 1
                with ddp.no_sync() if not sync else _null():
                    logits = ddp(
                        input_ids=inputs["input"], position_ids=inputs["positions"], use_cache=False
                    ).logits
                    loss = (
                        torch.nn.functional.cross_entropy(
                            logits.flatten(0, 1).float(),
                            labels.flatten(),
                            ignore_index=-100,
                            reduction="sum",
                        )
                        / valid
                    )
                    (loss * num_ranks).backward()
                loss_sum += loss.detach()
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(loss_sum)
            stats = loader.last_stats
            record["losses"].append(float(loss_sum))
            record["moved"].append(0 if stats is None else int(stats.num_moved))
            # Back to the Hugging Face layout (labels unshifted, -100 first) to read the
            # samples and count the labels as the other frameworks' records do.
            rows = [
                {
                    "input_ids": inputs["input"],
                    "cu_seq_lens_q": _cu(inputs["positions"]),
                    "labels": torch.cat([torch.full_like(y[:, :1], -100), y[:, :-1]], 1),
                }
                for inputs, y in micro
            ]
            record["steps"].append(
                {
                    "epoch": titan.view.epoch,
                    "samples": [fw.samples_of(r, index) for r in rows],
                    "num_items": int(valid),
                    "labels_world": fw.world_labels(rows),
                    "loss_world": loader.last_loss_tokens.world,
                }
            )
            done += 1
            if save_at and done == save_at:
                dcp.save(
                    {"dataloader": titan, "model": model.state_dict()}, checkpoint_id=checkpoint
                )
                if rank == 0:
                    with open(checkpoint + ".json", "w") as f:
                        json.dump({"done": done}, f)
    finally:
        titan.close()
    record["params"] = fw.params_bytes(model)
    return record


def _is_titan_base(titan: Any) -> bool | None:
    try:
        from torchtitan.components.dataloader import BaseDataLoader
    except Exception:
        return None
    return isinstance(titan, BaseDataLoader)


def _cu(positions: Any) -> Any:
    import torch

    starts = (positions[0] == 0).nonzero().flatten()
    return torch.cat([starts, torch.tensor([positions.shape[1]])]).to(torch.int32)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
