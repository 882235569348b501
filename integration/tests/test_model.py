"""DeepSeek-V4 as a torchtitan model: the build path torchtitan takes, the loss, the bias update."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torchtitan.components.optimizer import default_adamw
from torchtitan.distributed import ParallelDims

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.titan import DeepSeekV4LM, model_spec, parallelize


def _tokens(seed: int = 0, batch: int = 2, seq_len: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2048, (batch, seq_len + 1), generator=generator)


def _build_like_torchtitan(flavor: str = "debug") -> DeepSeekV4LM:
    """What torchtitan's Trainer does: build on meta, to_empty, init_weights."""
    config = model_spec(flavor).model
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    assert isinstance(model, DeepSeekV4LM)
    return model


def test_torchtitan_build_path_gives_every_buffer_its_initial_value() -> None:
    """Buffers are not random: after meta -> to_empty -> init_weights they must equal a direct
    build's (an uninitialised RoPE table would train silently on garbage)."""
    built = _build_like_torchtitan()
    direct = DeepSeekV4(DeepSeekV4Config.from_flavor("debug"))
    for (name, buffer), (_, expected) in zip(
        built.model.named_buffers(), direct.named_buffers(), strict=True
    ):
        assert torch.equal(buffer, expected), name


def test_forward_gives_logits_and_with_labels_the_models_own_loss() -> None:
    torch.manual_seed(0)
    lm = DeepSeekV4LM(model_spec("debug").model)
    sequence = _tokens()
    tokens, labels = sequence[:, :-1], sequence[:, 1:]
    assert lm(tokens).shape == (2, 32, 2048)
    loss = lm(tokens, labels=labels, positions=torch.arange(32))
    assert loss.dim() == 0
    assert torch.allclose(loss, lm.model.loss(tokens, labels))
    plain_ce = torch.nn.functional.cross_entropy(lm(tokens).flatten(0, 1), labels.flatten())
    assert not torch.allclose(loss, plain_ce)  # MTP and balance terms are in


def test_flops_count_routed_experts_at_top_k_over_experts() -> None:
    config = model_spec("debug").model
    lm = DeepSeekV4LM(config)
    total, flops = config.get_nparams_and_flops(lm, seq_len=128)
    assert total == sum(p.numel() for p in lm.parameters())
    routed = sum(p.numel() for n, p in lm.named_parameters() if ".experts." in n)
    assert 0 < routed < total
    assert flops == 6 * (total - routed + routed * 4 // 16)


def test_expert_bias_moves_after_each_optimizer_step_and_counts_reset() -> None:
    torch.manual_seed(0)
    spec = model_spec("debug")
    lm = DeepSeekV4LM(spec.model)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[lm])
    assert spec.post_optimizer_build_fn is not None
    spec.post_optimizer_build_fn(optimizers, [lm], None)
    sequence = _tokens()
    lm(sequence[:, :-1], labels=sequence[:, 1:]).backward()
    learned = [m for m in lm.model.modules() if getattr(m, "hash_routed", True) is False]
    assert learned and all(m.tokens_per_expert.sum() > 0 for m in learned)
    optimizers.step()
    assert all(m.expert_bias.abs().sum() > 0 for m in learned)
    assert all(m.tokens_per_expert.sum() == 0 for m in learned)


def test_model_spec_rejects_unknown_flavors_and_fields() -> None:
    with pytest.raises(ValueError, match="unknown DeepSeek-V4 flavor"):
        model_spec("huge")
    with pytest.raises(TypeError, match="no_such_field"):
        model_spec("debug", no_such_field=1)


def test_parallelize_names_the_degrees_it_does_not_support() -> None:
    lm = torch.nn.Linear(2, 2)
    single = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    assert parallelize(lm, parallel_dims=single) is lm
    sharded = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=2, world_size=4)
    with pytest.raises(ValueError, match=r"\{'dp_shard': 4, 'cp': 1, 'ep': 2\}"):
        parallelize(lm, parallel_dims=sharded)


def test_model_state_dict_has_no_wrapper_only_entries() -> None:
    lm = DeepSeekV4LM(model_spec("debug").model)
    keys = set(get_model_state_dict(lm))
    assert keys == {
        f"model.{k}" for k in DeepSeekV4(DeepSeekV4Config.from_flavor("debug")).state_dict()
    }
