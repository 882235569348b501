"""torchtitan recipes for DeepSeek-V4, one per flavor: ``--module ttnpu.dsv4 --config <name>``.

torchtitan's ConfigManager imports ``<module>.config_registry`` and calls the function named by
``--config``; dotted CLI overrides apply on top (``--training.steps 20``). Each function returns a
plain torchtitan ``Trainer.Config`` on :func:`ttnpu.dsv4.titan.model_spec`, so the stock trainer
trains on next-token cross-entropy; a trainer that calls the model with ``labels`` (ttnpu-trainer)
gets the full loss. Point ``--hf_assets_path`` at a tokenizer whose vocabulary fits the flavor
and ``--dataloader.dataset`` at the data. Needs the ``torchtitan`` extra.
"""

from __future__ import annotations

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.trainer import Trainer

from .titan import model_spec

__all__ = ["debug", "flash", "pro", "small"]


def _recipe(
    flavor: str, *, seq_len: int, batch: int, steps: int, lr: float, warmup: int, bf16: bool
) -> Trainer.Config:
    return Trainer.Config(
        model_spec=model_spec(flavor),
        loss=CrossEntropyLoss.Config(),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=warmup, decay_ratio=0.2, decay_type="cosine", min_lr_factor=0.1
        ),
        training=TrainingConfig(
            local_batch_size=batch,
            seq_len=seq_len,
            steps=steps,
            mixed_precision_param="bfloat16" if bf16 else "float32",
        ),
        metrics=MetricsProcessor.Config(log_freq=1 if steps <= 100 else 10),
        debug=DebugConfig(seed=0),
    )


def debug() -> Trainer.Config:
    """The tiny flavor (2048-token vocabulary), 256-token sequences: trains on CPU."""
    return _recipe("debug", seq_len=256, batch=4, steps=20, lr=2e-3, warmup=2, bf16=False)


def small() -> Trainer.Config:
    """The benchmark-sized flavor (8192-token vocabulary), 1k-token sequences."""
    return _recipe("small", seq_len=1024, batch=4, steps=200, lr=1e-3, warmup=20, bf16=False)


def flash() -> Trainer.Config:
    """DeepSeek-V4 Flash at 4k context, bf16 mixed precision."""
    return _recipe("flash", seq_len=4096, batch=1, steps=100_000, lr=2.2e-4, warmup=2000, bf16=True)


def pro() -> Trainer.Config:
    """DeepSeek-V4 Pro at 4k context, bf16 mixed precision."""
    return _recipe("pro", seq_len=4096, batch=1, steps=100_000, lr=2.2e-4, warmup=2000, bf16=True)
