"""Rank functions of the Hugging Face ``Trainer`` / TRL ``SFTTrainer`` adapter tests."""

from __future__ import annotations

import logging
from typing import Any

from testkit import frameworks as fw


def _tokenizer() -> Any:
    """A word-level tokenizer built in memory (TRL needs one with a pad token; no download)."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(fw.VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0"
    )


def train(
    rank: int, num_ranks: int, kind: str, out_dir: str, run: dict[str, Any]
) -> dict[str, Any]:
    """Train with ``kind`` ("trainer" or "sft"); report per step what each rank trained.

    ``save_at`` > 0: save a checkpoint after that many optimizer steps (and go on, as the
    uninterrupted reference run that the resumed one is compared with).
    ``resume``: resume from the last checkpoint in ``out_dir``. ``run``: ``balance``,
    ``epochs``, ``save_at``, ``resume``.
    """
    balance, epochs = bool(run["balance"]), int(run["epochs"])
    save_at, resume = int(run["save_at"]), bool(run["resume"])
    import torch
    import transformers

    from evenflow.engine import LoaderConfig
    from evenflow.engine.integrations.hf import EvenflowTrainer, with_evenflow

    logging.getLogger("transformers").setLevel(logging.ERROR)
    fw.one_thread()
    data = fw.dataset()
    index = fw.sample_index(data)
    record: dict[str, Any] = {"steps": [], "moved": [], "logs": []}

    base: Any = EvenflowTrainer
    extra: dict[str, Any] = {}
    if kind == "sft":
        import trl

        base = with_evenflow(trl.SFTTrainer)
        args_cls: Any = trl.SFTConfig
        extra = {"processing_class": _tokenizer()}
        # SFTConfig defaults to bf16 autocast and gradient checkpointing; the float32 model
        # keeps the comparison at float32 precision.
        arg_extra: dict[str, Any] = {
            "max_length": None,
            "dataset_num_proc": None,
            "bf16": False,
            "gradient_checkpointing": False,
        }
    else:
        args_cls = transformers.TrainingArguments
        arg_extra = {}

    class Recording(base):  # type: ignore[misc, valid-type]
        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            batch, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batch:
                stats = self.evenflow_loader.last_stats
                record["steps"].append(
                    {
                        "epoch": self.evenflow_view.epoch,
                        "samples": [fw.samples_of(mb, index) for mb in batch],
                        "num_items": int(num_items),
                        "labels_world": fw.world_labels(batch),
                        "loss_world": self.evenflow_loader.last_loss_tokens.world,
                    }
                )
                record["moved"].append(0 if stats is None else int(stats.num_moved))
            return batch, num_items

    class SaveAt(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if save_at and state.global_step == save_at:
                control.should_save = True
            return control

    class Logs(transformers.TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
            record["logs"].append(dict(logs or {}))
            return control

    args = args_cls(
        output_dir=out_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        num_train_epochs=epochs,
        learning_rate=fw.LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        use_cpu=True,
        seed=3,
        **arg_extra,
    )
    model = fw.model()
    record["start"] = fw.params_bytes(model)
    trainer = Recording(
        model=model,
        args=args,
        train_dataset=data,
        loader_config=LoaderConfig(
            seq_len=fw.SEQ_LEN, bins_per_rank=2, balance=balance, timeout=30.0, log_stats=False
        ),
        loader_kwargs={"cost_model": "quadratic"},
        callbacks=[SaveAt(), Logs()],
        **extra,
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    record["params"] = fw.params_bytes(trainer.model)
    record["losses"] = [log["loss"] for log in record["logs"] if "loss" in log]
    record["global_step"] = trainer.state.global_step
    _ = torch
    return record
