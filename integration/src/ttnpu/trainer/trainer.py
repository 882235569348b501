"""torchtitan's Trainer, trained on DeepSeek-V4's own loss, on the device the platform picks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from .corpus import register_dataset
from .platform import Platform, activate, detect

__all__ = ["DSV4Trainer", "init_optimizer_state"]


def init_optimizer_state(optimizers: OptimizersContainer) -> None:
    """Give every parameter its optimizer state now, as a fresh optimizer would hold it.

    Parameters that get no gradient (during DeepSeek-V4's dense indexer warm-up only the
    lightning indexers train, on their KL loss) would otherwise have no state in a checkpoint,
    while a restore initialises and expects state for all: resuming would fail on a missing
    key. torchtitan's ``state_dict`` creates the state with a zero-gradient, zero-lr step,
    which also counts a step; the count goes back to 0 so that the first real update has its
    full bias-corrected size (counted as step 2, AdamW's would be ~0.74x)."""
    optimizers.state_dict()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0


class DSV4Trainer(Trainer):
    """torchtitan's Trainer with three changes: the device comes from
    :mod:`ttnpu.trainer.platform` (cpu/gloo when there is no accelerator); the loss is the
    model's own (``model(tokens, labels=labels)``: next-token CE + MTP, balance and indexer
    losses) instead of a cross-entropy on the logits; optimizer state exists for every
    parameter from the start, so checkpoints restore."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
        """Device to train on; "auto" = the available accelerator (cuda, npu), else cpu."""

    platform: Platform
    _progress_start: tuple[int, float] | None = None

    def __init__(self, config: Config) -> None:
        self.platform = activate(detect(config.device))
        register_dataset()
        super().__init__(config)
        init_optimizer_state(self.optimizers)

    def train_step(
        self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> None:
        """torchtitan's step, then a progress line (step of total, elapsed, time left) whenever
        torchtitan logs the step's metrics."""
        if self._progress_start is None:
            self._progress_start = (self.step - 1, time.monotonic())
        super().train_step(data_iterator)
        if self.metrics_processor.should_log(self.step):
            first, start = self._progress_start
            elapsed = time.monotonic() - start
            total = self.config.training.steps
            left = elapsed / (self.step - first) * (total - self.step)
            logger.info(
                f"progress: step {self.step}/{total} ({100 * self.step / total:.0f}%), "
                f"{elapsed:.0f}s elapsed, ~{left:.0f}s left"
            )

    def _forward_backward_body(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor,
        extra_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """One microbatch: the model's mean loss over its valid tokens, rescaled so the
        microbatches of a step sum to the mean over the step's global valid tokens (the
        normalisation torchtitan's own losses use)."""
        with self.train_context():
            loss = self.model_parts[0](inputs, labels=labels)
            loss = loss * ((labels != IGNORE_INDEX).sum() / global_valid_tokens)
            loss.backward()
        return loss
