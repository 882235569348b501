"""DSV4Trainer's microbatch loss: the model's own loss, weighted so a step's microbatches add up
to the mean over the step's valid tokens (torchtitan's normalisation), with gradients to match;
its up-front optimizer state, which leaves the first update a plain first step; the
``--attention_backend`` switch."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
from torchtitan.components.optimizer import OptimizersContainer, default_adamw

from ttnpu.trainer import DeepSeekV4LM, DSV4Trainer, model_spec
from ttnpu.trainer.config_registry import CONFIGS
from ttnpu.trainer.trainer import _select_attention_backend, init_optimizer_state


def test_microbatch_losses_are_weighted_by_their_share_of_the_steps_valid_tokens() -> None:
    torch.manual_seed(0)
    lm = DeepSeekV4LM(model_spec("debug").model)
    trainer = SimpleNamespace(model_parts=[lm], train_context=contextlib.nullcontext)
    sequences = torch.randint(3, 2048, (2, 1, 33), generator=torch.Generator().manual_seed(1))
    batches = [(s[:, :-1], s[:, 1:].clone()) for s in sequences]
    batches[1][1][:, 20:] = -100  # the second microbatch has 20 valid tokens, the first 32
    total = torch.tensor(32 + 20)

    losses = [DSV4Trainer._forward_backward_body(trainer, t, lab, total, {}) for t, lab in batches]
    grads = [p.grad.clone() for p in lm.parameters() if p.grad is not None]

    with torch.no_grad():
        own = [lm.model.loss(t, lab) for t, lab in batches]
    assert torch.allclose(sum(losses), (own[0] * 32 + own[1] * 20) / 52, rtol=1e-5)

    lm.zero_grad()
    ((lm.model.loss(*batches[0]) * 32 + lm.model.loss(*batches[1]) * 20) / 52).backward()
    expected = [p.grad for p in lm.parameters() if p.grad is not None]
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected, strict=True))


def test_optimizer_state_made_up_front_leaves_the_first_update_a_plain_adamw_first_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    plain_model = copy.deepcopy(model)
    before = copy.deepcopy(model)
    optimizers = OptimizersContainer(default_adamw(lr=0.1), model_parts=[model])
    init_optimizer_state(optimizers)
    assert all(p in optimizers.optimizers[0].state for p in model.parameters())

    plain = torch.optim.AdamW(
        plain_model.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    x = torch.randn(5, 4)
    for m in (model, plain_model):
        m[0].requires_grad_(False)  # only the second layer gets a gradient this step
        m(x).square().sum().backward()
    optimizers.step()
    plain.step()
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert torch.equal(model[0].weight, before[0].weight)
    assert (model[1].weight - before[1].weight).abs().min() > 0.09  # lr x sign(grad), step 1


def test_attention_backend_option_sets_the_model_config_or_names_the_device_it_needs() -> None:
    config = CONFIGS["dsv4_debug"]()
    _select_attention_backend(config, "cpu")  # "model": the recipe's (chunked)
    assert config.model_spec.model.dsv4().attention_backend == "chunked"
    config.attention_backend = "reference"
    _select_attention_backend(config, "cpu")
    assert config.model_spec.model.dsv4().attention_backend == "reference"
    assert CONFIGS["dsv4_debug"]().model_spec.model.dsv4().attention_backend == "chunked"
    for backend, device in (("flex", "cuda"), ("npu", "npu")):
        config.attention_backend = backend
        with pytest.raises(ValueError, match=f"attention_backend {backend} runs on {device} only"):
            _select_attention_backend(config, "cpu")
