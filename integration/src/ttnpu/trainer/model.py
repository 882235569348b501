"""DeepSeek-V4 (``ttnpu.dsv4``) as a torchtitan model: config, module, parallelize step, ModelSpec.

torchtitan builds a model from a ``BaseModel.Config`` on the meta device, materialises it with
``to_empty`` and initialises it with ``init_weights``. :class:`DeepSeekV4LM` is that module: it
holds one plain-PyTorch :class:`ttnpu.dsv4.DeepSeekV4` and forwards to it. Called with ``labels``
it returns the model's full training loss (next-token CE + MTP, balance and indexer losses),
because only the model knows those terms; the trainer (:mod:`ttnpu.trainer.trainer`) calls it
that way, through ``__call__``, so that module hooks (FSDP, SDC checks, route capture) see
the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.protocols import BaseModel
from torchtitan.protocols.model_spec import ModelSpec

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config, update_expert_bias

__all__ = ["DeepSeekV4LM", "model_spec", "parallelize", "register_expert_bias_update"]


class DeepSeekV4LM(BaseModel):
    """torchtitan's handle on one :class:`ttnpu.dsv4.DeepSeekV4` (held as ``self.model``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        flavor: str = "debug"
        """``ttnpu.dsv4.DeepSeekV4Config.from_flavor`` name: debug, small, flash or pro."""

        overrides: dict[str, Any] = field(default_factory=dict)
        """DeepSeekV4Config fields replaced on top of the flavor (e.g. ``vocab_size``)."""

        expert_bias_rate: float = 1e-3
        """Step of the aux-loss-free expert-bias update applied after every optimizer step."""

        def dsv4(self) -> DeepSeekV4Config:
            return DeepSeekV4Config.from_flavor(self.flavor).replace(**self.overrides)

        def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
            seq_len, max_len = config.training.seq_len, self.dsv4().max_seq_len
            if seq_len > max_len:
                raise ValueError(
                    f"training.seq_len {seq_len} exceeds the {self.flavor} flavor's "
                    f"max_seq_len {max_len}"
                )

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            """Total parameters, and 6 x the parameters one token activates (routed experts
            counted at top-k / experts) as the training FLOPs per token."""
            c = self.dsv4()
            total = routed = 0
            for name, param in model.named_parameters():
                total += param.numel()
                if ".experts." in f".{name}":
                    routed += param.numel()
            active = total - routed + routed * c.n_activated_experts // c.n_routed_experts
            return total, 6 * active

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepSeekV4(config.dsv4())

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, **_: Any
    ) -> torch.Tensor:
        """Logits, or the training loss when ``labels`` are given. Other keyword inputs from
        torchtitan's dataloader (per-document ``positions``) are not used: DeepSeek-V4 attends
        causally over the packed sequence."""
        if labels is None:
            return self.model(tokens)
        return self.model.loss(tokens, labels)

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        self.model.init_weights()

    def verify_module_protocol(self) -> None:
        """The inner model is plain PyTorch by design (it is usable without torchtitan), so its
        submodules are not torchtitan ``Module``s; only the wrapper itself is."""


def parallelize(model: nn.Module, *, parallel_dims: ParallelDims, **_: Any) -> nn.Module:
    """One rank per replica group: data parallelism across groups is to come from torchft's
    replica groups (the ttnpu-ft wiring, planned); sharding inside a group (FSDP/TP/EP/CP/PP)
    is not wired in this trainer yet."""
    degrees = {
        name: getattr(parallel_dims, name)
        for name in ("dp_shard", "dp_replicate", "tp", "cp", "pp", "ep")
        if getattr(parallel_dims, name) > 1
    }
    if degrees:
        raise ValueError(
            f"ttnpu-trainer runs DeepSeek-V4 on one rank per replica group; unsupported "
            f"parallelism degrees {degrees} (set them to 1)"
        )
    return model


def register_expert_bias_update(
    optimizers: OptimizersContainer, model_parts: list[nn.Module], parallel_dims: ParallelDims
) -> None:
    """After every optimizer step, move each learned-gate MoE's expert bias towards balance
    from the step's token counts (and reset the counts)."""

    def update(*_: Any) -> None:
        for part in model_parts:
            assert isinstance(part, DeepSeekV4LM)
            update_expert_bias(part.model, part.config.expert_bias_rate)

    optimizers.register_step_post_hook(update)


def model_spec(flavor: str, **overrides: Any) -> ModelSpec:
    """The ModelSpec for a DeepSeek-V4 flavor, with DeepSeekV4Config fields replaced."""
    DeepSeekV4Config.from_flavor(flavor).replace(**overrides)  # fail here on a bad flavor/field
    return ModelSpec(
        name="deepseek_v4",
        flavor=flavor,
        model=DeepSeekV4LM.Config(flavor=flavor, overrides=overrides),
        parallelize_fn=parallelize,
        pipelining_fn=None,
        post_optimizer_build_fn=register_expert_bias_update,
        state_dict_adapter=None,
    )
