"""DeepSeek-V4 as a torchtitan model: config, module, parallelize step, ModelSpec.

Needs the ``torchtitan`` extra (``pip install ttnpu-dsv4[torchtitan]``); ``import ttnpu.dsv4``
does not import this module, so the model stays usable without torchtitan.

torchtitan builds a model from a ``BaseModel.Config`` on the meta device, materialises it with
``to_empty`` and initialises it with ``init_weights``. :class:`DeepSeekV4LM` is that module: it
holds one plain-PyTorch :class:`~ttnpu.dsv4.DeepSeekV4` and forwards to it. Called without
``labels`` it returns logits (what torchtitan's own ``Trainer`` feeds its loss); called with
``labels`` it returns the model's full training loss (next-token CE + MTP, balance and indexer
losses), because only the model knows those terms. A trainer that wants the full loss calls it
that way, through ``__call__``, so that module hooks (FSDP, checks, route capture) see the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.protocols import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from .ac_compile import apply_activation_checkpointing, apply_compile, check_options
from .config import DeepSeekV4Config
from .hf_checkpoint import HFCheckpointReader, from_hf, to_hf
from .model import DeepSeekV4
from .moe import GroupedExperts, update_expert_bias
from .parallel import (
    apply_context_parallel,
    apply_expert_parallel,
    apply_fsdp,
    check_context_parallel,
)

__all__ = [
    "DeepSeekV4LM",
    "DeepSeekV4StateDictAdapter",
    "model_spec",
    "parallelize",
    "register_expert_bias_update",
]


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
            if (cp := config.parallelism.context_parallel_degree) > 1:
                check_context_parallel(self.dsv4(), seq_len, cp)

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


def parallelize(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig | None = None,
    parallelism: ParallelismConfig | None = None,
    compile_config: CompileConfig | None = None,
    ac_config: ActivationCheckpointingConfig | None = None,
    dump_folder: str = "",
) -> nn.Module:
    """torchtitan's ``parallelize_fn`` (the keywords its Trainer passes): context parallelism
    over the ``cp`` mesh, expert parallelism over the ``ep`` mesh, ``torch.compile`` and activation
    checkpointing per block (:mod:`ttnpu.dsv4.ac_compile`, from ``compile_config`` and
    ``ac_config``, also on one rank) and FSDP2 over the data x context ranks, applied to the model
    built on the meta device (torchtitan then calls ``to_empty`` and ``init_weights``, which give
    every rank the shards of the unsharded init). EP borrows the whole FSDP group (``ep`` is 1 or
    ``dp_shard * cp``); FSDP params use ``training.mixed_precision_param`` / ``_reduce``. Other
    parallelisms (tp, pp, dp_replicate; replicas come from the trainer, e.g. torchft groups), and
    compile or activation-checkpointing options the model cannot honour, raise ValueError naming
    them, before the model is changed.

    Under CP every rank of a CP group is fed the same batch (torchtitan's dataloader shards over
    the ``batch`` mesh only) and the model computes its slice of the sequences; the trainer must
    not shard the inputs itself (``DSV4Trainer`` does not).

    Gradients are summed over the ranks, not averaged (torchtitan's contract): its trainer
    already divides every rank's loss by the global number of valid tokens, so FSDP's division
    and the EP experts' 1/ep scale are turned off here."""
    unsupported = {
        name: getattr(parallel_dims, name)
        for name in ("dp_replicate", "tp", "pp")
        if getattr(parallel_dims, name) > 1
    }
    if unsupported:
        raise ValueError(
            f"the torchtitan DeepSeek-V4 supports FSDP (dp_shard), context (cp) and expert (ep) "
            f"parallelism only; unsupported parallelism degrees {unsupported} (set them to 1)"
        )
    dp_shard, cp, ep = parallel_dims.dp_shard, parallel_dims.cp, parallel_dims.ep
    if ep not in (1, dp_shard * cp):
        raise ValueError(
            f"unsupported parallelism degrees {{'dp_shard': {dp_shard}, 'cp': {cp}, 'ep': {ep}}}: "
            f"ep must be 1 or dp_shard x cp, experts are sharded over the whole FSDP group (FSDP "
            f"of the experts over the remaining efsdp group is not supported)"
        )
    check_options(ac_config, compile_config)
    compiles = compile_config is not None and compile_config.enable
    if dp_shard * cp == 1 and ac_config is None and not compiles:
        return model  # nothing to apply
    if not isinstance(model, DeepSeekV4LM):
        raise ValueError(f"parallelize shards a DeepSeekV4LM, got {type(model).__name__}")
    check_options(ac_config, compile_config, model.model)
    if cp > 1:
        apply_context_parallel(model.model, parallel_dims.get_mesh("cp"))
    if ep > 1:
        apply_expert_parallel(model.model, parallel_dims.get_mesh("ep"))
        for experts in model.modules():
            if isinstance(experts, GroupedExperts):
                experts.grad_scale = 1.0
    apply_compile(model.model, compile_config)  # compiled blocks are checkpointed, not the reverse
    apply_activation_checkpointing(model.model, ac_config, dump_folder)
    if dp_shard * cp == 1:
        return model
    apply_fsdp(model.model, _fsdp_mesh(parallel_dims), _mixed_precision(training))
    _sum_gradients(model)
    return model


def _sum_gradients(model: nn.Module) -> None:
    """FSDP reduce-scatters with a plain SUM and divides by nothing (a divide factor of 1 alone
    would use PREMUL_SUM, which gloo lacks)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The 1-D mesh of the data x context ranks: ``fsdp`` in torchtitan's ``partial_dtensor``
    backend; in its ``spmd_types`` and ``full_dtensor`` backends ``dp_shard`` without CP, and the
    flattened ``loss`` mesh (batch x cp, batch = dp_shard here) with it."""
    if parallel_dims.spmd_backend != "partial_dtensor" and parallel_dims.cp > 1:
        return parallel_dims.get_mesh("loss")
    name = "fsdp" if parallel_dims.spmd_backend == "partial_dtensor" else "dp_shard"
    return parallel_dims.get_mesh(name)


def _mixed_precision(training: TrainingConfig | None) -> MixedPrecisionPolicy:
    if training is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )


def register_expert_bias_update(
    optimizers: OptimizersContainer,
    model_parts: list[nn.Module],
    parallel_dims: ParallelDims | None,
) -> None:
    """After every optimizer step, move each learned-gate MoE's expert bias towards balance
    from the step's token counts (and reset the counts). Under data and context parallelism the
    counts are summed over the data x context (``loss``) mesh first, so every rank of the replica
    applies the same update (``parallel_dims`` None: one rank)."""
    batch_mesh = None
    if parallel_dims is not None and parallel_dims.dp_cp_enabled:
        batch_mesh = parallel_dims.get_optional_mesh("loss")

    def summed(counts: torch.Tensor) -> torch.Tensor:
        assert batch_mesh is not None
        counts = counts.clone()
        dist.all_reduce(counts, group=batch_mesh.get_group())
        return counts

    def update(*_: Any) -> None:
        for part in model_parts:
            assert isinstance(part, DeepSeekV4LM)
            reduce = summed if batch_mesh is not None else None
            update_expert_bias(part.model, part.config.expert_bias_rate, reduce_counts=reduce)

    optimizers.register_step_post_hook(update)


class DeepSeekV4StateDictAdapter(StateDictAdapter):
    """torchtitan's bridge to transformers' DeepseekV4 checkpoints, for
    ``--checkpoint.initial_load_in_hf`` and ``--checkpoint.last_save_in_hf``: the names of
    :mod:`ttnpu.dsv4.hf_checkpoint` (the ``model.`` of :class:`DeepSeekV4LM` taken off), loaded
    through its reader (official or transformers names, checked before anything changes; a
    folder without MTP weights leaves the MTP layers as initialised) and saved one shard per
    block (``model.safetensors.index.json`` included). ``hf_assets_path`` is the tokenizer's
    folder here, so no shard layout is taken from it."""

    def __init__(self, model_config: DeepSeekV4LM.Config, hf_assets_path: str | None) -> None:
        self.model_config = model_config
        self.hf_assets_path = hf_assets_path
        blocks = {key: _block(key) for key in self._expected()}
        shard = {block: i for i, block in enumerate(sorted(set(blocks.values())), start=1)}
        self.fqn_to_index_mapping = {key: shard[block] for key, block in blocks.items()}

    def _expected(self) -> dict[str, torch.Size]:
        with torch.device("meta"):
            state = DeepSeekV4(self.model_config.dsv4()).state_dict()
        return {k: v.shape for k, v in to_hf(state).items()}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """transformers' names; the hash-routing tables as float32 copies, because torch's
        consolidation of sharded HF saves cannot size integer tensors (pytorch/pytorch#192485).
        Expert ids are exact in float32, and transformers and this adapter cast them back."""
        hf = to_hf({k.removeprefix("model."): v for k, v in state_dict.items()})
        return {k: v if v.is_floating_point() else v.float() for k, v in hf.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in from_hf(hf_state_dict).items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> HFCheckpointReader:
        if from_quantized:
            raise ValueError(
                "checkpoint.initial_load_in_hf_quantized: quantized DeepSeek-V4 checkpoints "
                "are not supported; load a dequantized one"
            )
        return HFCheckpointReader(path, self._expected())

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` that makes a saved folder loadable by transformers."""
        return self.model_config.dsv4().to_hf_config()


def _block(hf_key: str) -> tuple[int, int]:
    """Shard order of a transformers key: embeddings, head and norms, the layers, MTP blocks."""
    parts = hf_key.split(".")
    if parts[0] == "mtp":
        return (2, int(parts[1]))
    return (1, int(parts[2])) if parts[:2] == ["model", "layers"] else (0, 0)


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
        state_dict_adapter=DeepSeekV4StateDictAdapter,
    )
