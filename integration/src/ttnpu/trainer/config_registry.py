"""Named training recipes, in torchtitan's style: each function returns a complete trainer config.

torchtitan's ConfigManager finds them with ``--module ttnpu.trainer --config <name>`` and applies
dotted overrides on top (``--training.steps 20 --optimizer.param_groups...``); ``ttnpu-train``
passes ``--module`` for you and defaults ``--config`` to ``dsv4_debug``.

- ``dsv4_debug``: the tiny DeepSeek-V4 on the bundled corpus; a few minutes on 2 CPU cores.
- ``dsv4_small``: the benchmark-sized flavor, same data, longer sequences.
- ``dsv4_flash``: DeepSeek-V4 Flash, for an accelerator cluster with its own tokenizer and data.
- ``dsv4_flash_ft``: one replica group of the reference experiments' two-replica, 128-die recipe
  (FSDP 64 x EP 64, checkpoints every 100 steps) as a torchft replica group; launch each group
  under torchrun with ``TORCHFT_LIGHTHOUSE`` and ``--fault_tolerance.replica_id 0|1``.

Every recipe carries the feature switches (``--fault_tolerance.*``, ``--sdc.*``, ``--spike.*``,
see :mod:`ttnpu.trainer.features`): SDC detection is on everywhere (gradient statistics, checksums
on escalation and on re-runs), loss-spike rollback on the Flash recipes.
"""

from __future__ import annotations

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import TrainingConfig
from torchtitan.config.configs import CompileConfig, DebugConfig, ParallelismConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from ttnpu.dsv4.titan import model_spec

from .checkpoint import ChecksummedCheckpointManager
from .corpus import DATASET_NAME, register_dataset, tokenizer_path
from .features import FaultTolerance, SpikeRecovery
from .trainer import DSV4Trainer

__all__ = ["CONFIGS", "dsv4_debug", "dsv4_flash", "dsv4_flash_ft", "dsv4_small"]

register_dataset()

# Vocabulary of the bundled tokenizer (tools/prepare_corpus.py); the small flavors are sized to it.
_BUNDLED_VOCAB = 2048


def _bundled(
    flavor: str, *, steps: int, seq_len: int, batch: int, lr: float, warmup: int, ckpt: int
) -> DSV4Trainer.Config:
    """A single-process run of ``flavor`` on the bundled corpus and tokenizer."""
    return DSV4Trainer.Config(
        model_spec=model_spec(flavor, vocab_size=_BUNDLED_VOCAB),
        hf_assets_path=tokenizer_path(),
        dump_folder="runs",
        loss=CrossEntropyLoss.Config(),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET_NAME),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=warmup, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1
        ),
        # fp32 compute under FSDP too: bf16 matmuls are slow on CPU, and the small recipes are
        # what the tests compare sharded and unsharded runs with
        training=TrainingConfig(
            local_batch_size=batch,
            seq_len=seq_len,
            steps=steps,
            gc_freq=50,
            mixed_precision_param="float32",
        ),
        metrics=MetricsProcessor.Config(log_freq=1, enable_tensorboard=True),
        checkpoint=ChecksummedCheckpointManager.Config(
            enable=True,
            interval=ckpt,
            last_save_model_only=False,
            keep_latest_k=2,
            initial_load_model_only=False,
        ),
        debug=DebugConfig(seed=0),
        # no activation checkpointing on these small runs (torchtitan's default is selective);
        # --compile.enable compiles the model's blocks (the loss is the model's own: torchtitan's
        # default components also name its loss function, which DSV4Trainer does not use)
        activation_checkpoint=None,
        compile=CompileConfig(components=["model"]),
    )


def dsv4_debug() -> DSV4Trainer.Config:
    """The tiny DeepSeek-V4 on the bundled corpus: 40 steps, a few minutes on 2 CPU cores."""
    return _bundled("debug", steps=40, seq_len=128, batch=4, lr=2e-3, warmup=4, ckpt=20)


def dsv4_small() -> DSV4Trainer.Config:
    """The benchmark-sized DeepSeek-V4 on the bundled corpus, 512-token sequences."""
    return _bundled("small", steps=200, seq_len=512, batch=4, lr=1e-3, warmup=20, ckpt=50)


def dsv4_flash() -> DSV4Trainer.Config:
    """Flash at 4k context in bf16 mixed precision; point ``--hf_assets_path`` at DeepSeek-V4's
    tokenizer and ``--dataloader.dataset``/``--dataloader.dataset_path`` at the training data."""
    return DSV4Trainer.Config(
        model_spec=model_spec("flash"),
        dump_folder="runs",
        loss=CrossEntropyLoss.Config(),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        optimizer=default_adamw(lr=2.2e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2000, decay_ratio=0.2, decay_type="cosine", min_lr_factor=0.1
        ),
        training=TrainingConfig(
            local_batch_size=1, seq_len=4096, steps=100_000, mixed_precision_param="bfloat16"
        ),
        metrics=MetricsProcessor.Config(log_freq=10, enable_tensorboard=True),
        checkpoint=ChecksummedCheckpointManager.Config(
            enable=True,
            interval=500,
            last_save_model_only=False,
            keep_latest_k=3,
            initial_load_model_only=False,
        ),
        debug=DebugConfig(seed=0),
        spike=SpikeRecovery(enable=True),
        compile=CompileConfig(components=["model"]),
    )


def dsv4_flash_ft() -> DSV4Trainer.Config:
    """``dsv4_flash`` as one of the two replica groups of the 128-die reference recipe: 64 dies,
    FSDP 64 x EP 64, checkpointing every 100 steps into ``../checkpoint``, shared by the groups
    (one copy of the model and optimizer; the groups' run folders side by side on shared storage,
    as ``examples/slurm`` puts them), torchft with a Lighthouse from ``TORCHFT_LIGHTHOUSE``; pass
    ``--fault_tolerance.replica_id``."""
    config = dsv4_flash()
    config.parallelism = ParallelismConfig(data_parallel_shard_degree=64, expert_parallel_degree=64)
    config.checkpoint.interval = 100
    config.fault_tolerance = FaultTolerance(
        enable=True, group_size=2, min_replica_size=1, checkpoint_folder="../checkpoint"
    )
    return config


CONFIGS = {fn.__name__: fn for fn in (dsv4_debug, dsv4_small, dsv4_flash, dsv4_flash_ft)}
"""Every recipe by name (what ``ttnpu-train --config`` accepts)."""
