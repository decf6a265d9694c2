"""A Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``) on balanced, packed steps.

What it shows (docs/howto/hf-trainer.md walks through it):

* the few lines that put evenflow under a ``Trainer`` you already have: ``EvenflowTrainer``
  in place of ``Trainer`` (``with_evenflow(SFTTrainer)`` for TRL) and ``seq_len=``; the
  loader is built from the trainer's own arguments (rank, world size, seed,
  ``per_device_train_batch_size x gradient_accumulation_steps`` bins per step);
* two epochs, each its own shuffled pass;
* ``num_items_in_batch`` = the world's loss tokens of the step, so the loss is the world's
  mean token loss under balancing;
* the balance of every step in the Trainer's own logs (``evenflow/...`` keys);
* an exact resume from the Trainer's checkpoint (``--resume``): the loader's state is in the
  checkpoint folder, one file per rank.

The model is a tiny random-weight Llama built from a config and the data an in-memory
``datasets.Dataset``; nothing is downloaded. Run it with::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py

Options: ``--epochs N`` (default 2), ``--save-steps N`` (checkpoint every N steps, default 3),
``--out DIR`` (default ./evenflow-trainer), ``--resume`` (continue from the last checkpoint in
``--out``), ``--sft`` (TRL's ``SFTTrainer`` instead of ``Trainer``), ``--samples N``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_training_loop import tiny_llama, tokenized_dataset

SEQ_LEN = 128


class PrintLogs(transformers.TrainerCallback):
    """Print the Trainer's log lines on rank 0: the loss and evenflow's balance of the step."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            print(
                f"step {state.global_step}: loss {logs['loss']:.4f}, max cost "
                f"{logs['evenflow/max_cost_before']:.3g} -> "
                f"{logs['evenflow/max_cost_after']:.3g}, moved "
                f"{int(logs['evenflow/moved_samples'])}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", default="evenflow-trainer")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--sft", action="store_true")
    options = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = tiny_llama(SEQ_LEN)  # use_cache=False
    dataset = tokenized_dataset(options.samples, SEQ_LEN)  # input_ids, labels
    args_class: Any = transformers.TrainingArguments
    extra: dict[str, Any] = {}
    if options.sft:
        import trl

        # SFTConfig's defaults: bf16 autocast and gradient checkpointing; this tiny model on a
        # CPU trains in float32 without them.
        args_class, extra = trl.SFTConfig, {"bf16": False, "gradient_checkpointing": False}
    args = args_class(
        output_dir=options.out,
        per_device_train_batch_size=1,  # packed bins of seq_len tokens per microbatch
        gradient_accumulation_steps=2,
        num_train_epochs=options.epochs,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=options.save_steps,
        report_to=[],
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        use_cpu=not torch.cuda.is_available(),  # Gloo ranks on a machine without GPUs
        **extra,
    )
    trainer_class: Any = transformers.Trainer
    if options.sft:
        import trl

        trainer_class = trl.SFTTrainer
    more: dict[str, Any] = {"processing_class": _tokenizer()} if options.sft else {}

    # -- evenflow (docs/howto/hf-trainer.md shows this block as it is) --
    from evenflow.engine.integrations.hf import with_evenflow

    Trainer = with_evenflow(trainer_class)  # EvenflowTrainer for transformers.Trainer
    trainer = Trainer(
        model=model,
        args=args,  # rank, world size, seed, batch size x accumulation, epochs: from here
        train_dataset=dataset,
        seq_len=SEQ_LEN,  # tokens per packed bin (one bin per microbatch here)
        callbacks=[PrintLogs()],
        **more,
    )
    # --
    trainer.remove_callback(transformers.PrinterCallback)  # PrintLogs prints the lines
    result = trainer.train(resume_from_checkpoint=options.resume or None)

    if trainer.is_world_process_zero():
        print(f"trained {result.global_step} steps; final loss {result.training_loss:.4f}")
    return 0


def _tokenizer() -> Any:
    """TRL needs a tokenizer with a pad token; this one is built in memory (no download)."""
    import tokenizers

    vocab = {f"t{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0"
    )


if __name__ == "__main__":
    raise SystemExit(main())
