"""Adapters that put evenflow's loader into the training frameworks people already use.

One module per framework; importing one never imports another framework:

* :mod:`evenflow.engine.integrations.hf` — Hugging Face ``Trainer`` and TRL's ``SFTTrainer``
  (``EvenflowTrainer``, ``with_evenflow``).
* :mod:`evenflow.engine.integrations.accelerate` — Accelerate without the Trainer
  (``prepare_with_loader``).
* :mod:`evenflow.engine.integrations.lightning` — PyTorch Lightning (``EvenflowDataModule``).
* :mod:`evenflow.engine.integrations.torchtitan` — torchtitan's dataloader protocol
  (``TitanLoader``).

Each maps the framework's microbatches and gradient accumulation onto the loader's bins per
rank, starts every epoch with ``set_epoch``, keeps the loader's state in the framework's own
checkpoint and restores it exactly, and never lets the framework re-shard what the loader
already assigned to each rank.
"""

from evenflow.engine.integrations._common import LoaderView, merge_packed

__all__ = ["LoaderView", "merge_packed"]
