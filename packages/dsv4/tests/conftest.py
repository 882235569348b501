from collections.abc import Callable

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config

# One thread: the CI machine is shared, and OpenMP threads spinning on oversubscribed cores make
# these small ops an order of magnitude slower.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture
def tiny() -> DeepSeekV4Config:
    """Smaller than the debug flavor (fast tests); every mechanism still active."""
    return DeepSeekV4Config.from_flavor("debug").replace(
        vocab_size=97,
        dim=64,
        n_layers=5,
        compress_ratios=(0, 4, 8, 4, 8),
        n_heads=4,
        head_dim=32,
        rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        window_size=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=3,
        n_routed_experts=8,
        n_activated_experts=2,
        moe_inter_dim=32,
        n_hash_layers=2,
    )


def _terms_and_grads(
    config: DeepSeekV4Config, state: dict[str, torch.Tensor], tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(Every loss term, every parameter gradient) of ``config``'s model at ``state``."""
    model = DeepSeekV4(config).to(tokens.device)
    model.load_state_dict(state)
    labels = torch.roll(tokens, -1, 1)
    labels[:, 5] = -100
    terms = model.losses(tokens, labels)
    terms.total.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack([t.detach() for t in terms]), grads


MatchesReference = Callable[..., torch.Tensor]


@pytest.fixture
def matches_reference() -> MatchesReference:
    """``check(config, tokens, tolerance=1e-5)``: ``config``'s attention backend gives the
    ``reference`` backend's loss terms and every parameter gradient (relative to each gradient's
    largest entry) from the same weights; returns the reference's terms (total, lm, mtp,
    balance, indexer)."""

    def check(config: DeepSeekV4Config, tokens: torch.Tensor, tolerance: float = 1e-5):
        state = DeepSeekV4(config).state_dict()
        reference = config.replace(attention_backend="reference")
        want, want_grads = _terms_and_grads(reference, state, tokens)
        got, grads = _terms_and_grads(config, state, tokens)
        assert grads.keys() == want_grads.keys()
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        for name, grad in grads.items():
            scale = want_grads[name].abs().max().clamp_min(1e-3)
            assert (grad - want_grads[name]).abs().max() / scale < tolerance, name
        return want

    return check
