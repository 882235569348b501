"""DSV4Trainer's microbatch loss: the model's own loss, weighted so a step's microbatches add up
to the mean over the step's valid tokens (torchtitan's normalisation), with gradients to match."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from ttnpu.trainer import DeepSeekV4LM, DSV4Trainer, model_spec


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
