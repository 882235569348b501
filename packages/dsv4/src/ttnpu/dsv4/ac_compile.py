"""Activation checkpointing and ``torch.compile`` of DeepSeek-V4's blocks, configured by
torchtitan 0.3's own config sections (``activation_checkpoint``, ``compile``); applied by
:func:`ttnpu.dsv4.titan.parallelize`. Needs the ``torchtitan`` extra.

Per transformer block (``model.layers``) and per MTP block (``model.mtp``):

* ``activation_checkpoint:full``: torchtitan's ``FullAC``, the block's forward is recomputed in
  the backward (for an MTP block: its whole ``predict``, which runs the block's forward directly).
* ``activation_checkpoint:selective``: torchtitan's per-op ``SelectiveAC`` policy and save set
  (matmuls but every second ``mm``, ``bmm``, ``topk``, and the outputs of
  ``_c10d_functional.all_to_all_single``, so that the expert-parallel token exchange is not sent
  again in the backward). The experts' ``_grouped_mm`` is not added to it: the experts' autograd
  node recomputes its matmuls in its own backward, so caching their outputs would keep what it
  discards (measured on the micro model: 0.98 of the no-AC bytes held, against 0.87 without).
* ``activation_checkpoint:none``: nothing.
* ``compile.enable`` with ``"model"`` in ``compile.components``: each block is compiled with
  ``torch.compile(backend=compile.backend)``. Graph breaks are allowed (torchtitan compiles with
  ``fullgraph=True``): the MoE's routed-expert dispatch (token sort, grouped matmuls, the
  expert-parallel all-to-all) runs eagerly, because its shapes depend on the routing and because
  torch 2.14's fake kernel of ``torch._grouped_mm`` rejects fp32 (which the CPU kernel runs).
  ``"loss"`` is the trainer's loss function, compiled by torchtitan's Trainer, not here.

Order: the blocks are compiled first and the compiled blocks are checkpointed (torchtitan does the
opposite, compiling the checkpointed block in one graph). Under dynamo a checkpointed region must
be free of side effects and graph breaks, and a MoE block has both (the routed-token counters,
the routers' ``last_indices``, the eager dispatch): dynamo would give up on the whole block.

Refused with a ``ValueError`` naming the option (nothing is ignored): ``activation_checkpoint:
memory-budget`` (the compiler's partitioner would budget only the compiled parts of a block, not
its eager expert dispatch), compile components other than ``model`` and ``loss``, an unknown
``compile.backend``, ``compile.enable_async_tensor_parallel`` (no tensor parallelism) and
``force_recompute_mm_shapes_by_fqns`` entries that match no ``nn.Linear`` of a block (torchtitan's
default, ``moe.router.gate``, names its own MoE layout and matches nothing here, as in its dense
models; it is accepted).

Under activation checkpointing a block's forward runs twice, so the MoE ``tokens_per_expert``
counters count every routed token twice (torchtitan's MoE does the same); the expert-bias update
only uses the sign of ``mean - count`` per layer, so it is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torchtitan.config.configs import CompileConfig
from torchtitan.distributed.activation_checkpoint import (
    ActivationCheckpointingConfig,
    FullAC,
    MemoryBudgetAC,
    SelectiveAC,
)

from .model import DeepSeekV4, MTPBlock
from .moe import Dispatch, MoE

__all__ = [
    "COMPILE_COMPONENTS",
    "apply_activation_checkpointing",
    "apply_compile",
    "check_options",
]

COMPILE_COMPONENTS = ("model", "loss")
"""``compile.components`` this model honours: its blocks, and the trainer's loss function."""

_DEFAULT_RECOMPUTE_FQNS = SelectiveAC.Config().force_recompute_mm_shapes_by_fqns


def check_options(
    ac_config: ActivationCheckpointingConfig | None,
    compile_config: CompileConfig | None,
    model: DeepSeekV4 | None = None,
) -> None:
    """Raise ``ValueError`` naming the first activation-checkpointing or compile option that the
    model cannot honour (call it before anything is changed); with ``model``, also check the
    selective policy's module names against its blocks."""
    if ac_config is not None and not isinstance(ac_config, FullAC.Config | SelectiveAC.Config):
        name = "memory-budget" if isinstance(ac_config, MemoryBudgetAC.Config) else ac_config
        raise ValueError(
            f"activation_checkpoint:{name} is not supported by the DeepSeek-V4 model: the "
            f"compiler's memory budget would reach only the compiled parts of a block, not its "
            f"eager expert dispatch; use activation_checkpoint:full, :selective or :none"
        )
    if model is not None and isinstance(ac_config, SelectiveAC.Config):
        _check_recompute_fqns(model, ac_config.force_recompute_mm_shapes_by_fqns)
    if compile_config is None or not compile_config.enable:
        return
    unknown = [c for c in compile_config.components if c not in COMPILE_COMPONENTS]
    if unknown:
        raise ValueError(
            f"compile.components {unknown} are not supported by the DeepSeek-V4 model; "
            f"expected a subset of {list(COMPILE_COMPONENTS)}"
        )
    if compile_config.enable_async_tensor_parallel:
        raise ValueError(
            "compile.enable_async_tensor_parallel is not supported by the DeepSeek-V4 model: it "
            "has no tensor parallelism"
        )
    backends = torch.compiler.list_backends(exclude_tags=())
    if compile_config.backend not in backends:
        raise ValueError(
            f"compile.backend {compile_config.backend!r} is not a torch.compile backend; "
            f"expected one of {backends}"
        )


def _blocks(model: DeepSeekV4) -> Iterator[tuple[str, nn.Module]]:
    """(fqn, block) of every transformer block, then every MTP block."""
    for prefix, blocks in (("layers", model.layers), ("mtp", model.mtp)):
        for index, block in enumerate(blocks):
            yield f"{prefix}.{index}", block


def _check_recompute_fqns(model: DeepSeekV4, fqns: list[str]) -> None:
    """Every ``force_recompute_mm_shapes_by_fqns`` entry must match an ``nn.Linear`` of a block
    (and nothing else), as torchtitan's policy requires; its default is accepted as is."""
    if fqns == _DEFAULT_RECOMPUTE_FQNS:
        return
    modules = [
        (f"{base}.{name}" if name else base, module)
        for base, block in _blocks(model)
        for name, module in block.named_modules()
    ]
    for wanted in fqns:
        matched = [(fqn, m) for fqn, m in modules if wanted in fqn]
        wrong = [fqn for fqn, m in matched if not isinstance(m, nn.Linear)]
        if not matched or wrong:
            found = f"it matches {wrong[:3]}, not nn.Linear" if wrong else "it matches nothing"
            raise ValueError(
                f"activation_checkpoint.force_recompute_mm_shapes_by_fqns entry {wanted!r}: "
                f"{found} in the DeepSeek-V4 blocks (e.g. 'attn.wq_a', 'shared_experts.w1')"
            )


def apply_activation_checkpointing(
    model: DeepSeekV4, ac_config: ActivationCheckpointingConfig | None, dump_folder: str = ""
) -> None:
    """Checkpoint every block of ``model`` as ``ac_config`` says (None: nothing). Transformer
    blocks are replaced by torchtitan's ``CheckpointWrapper``s (parameter names gain
    ``_checkpoint_wrapped_module.``; state dicts do not); an MTP block stays in place and its
    ``predict`` is checkpointed. Apply it after :func:`apply_compile` and before FSDP."""
    check_options(ac_config, None, model)
    if ac_config is None:
        return
    policy = ac_config.build(dump_folder=dump_folder)
    policy.apply(model)
    for fqn, block in _blocks(model):
        if fqn.startswith("mtp."):
            # predict() calls the block's forward directly, which a wrapper would not see; take
            # the wrapper's checkpoint function (the policy's settings) and run predict under it.
            wrapper = policy._wrap_block(block, base_fqn=fqn)
            checkpoint_fn = cast(Callable[..., Any], wrapper.checkpoint_fn)
            _set_predict(block, partial(checkpoint_fn, cast(MTPBlock, block).predict))


def _set_predict(block: nn.Module, predict: Callable[..., Any]) -> None:
    """From now on the MTP block's ``predict`` (an instance attribute) runs ``predict``."""
    block.__dict__["predict"] = predict


def _eager(dispatch: Dispatch) -> Dispatch:
    return cast(
        Dispatch,
        torch.compiler.disable(
            dispatch, reason="routing-dependent shapes; no fp32 fake kernel of _grouped_mm"
        ),
    )


def apply_compile(model: DeepSeekV4, compile_config: CompileConfig | None) -> bool:
    """``torch.compile`` every block of ``model`` (an MTP block: its ``predict``) with
    ``compile_config.backend`` when ``compile.enable`` and ``"model"`` is a component, leaving
    every MoE's routed-expert dispatch eager. Returns whether it compiled. Apply it after expert
    parallelism (which replaces the dispatch) and before :func:`apply_activation_checkpointing`."""
    check_options(None, compile_config)
    if compile_config is None or not compile_config.enable:
        return False
    if "model" not in compile_config.components:
        return False
    for module in model.modules():
        if isinstance(module, MoE):
            module.dispatch = _eager(module.dispatch)
    for fqn, block in _blocks(model):
        if fqn.startswith("mtp."):
            predict = cast(MTPBlock, block).predict
            _set_predict(block, torch.compile(predict, backend=compile_config.backend))
        else:
            block.compile(backend=compile_config.backend)
    return True
