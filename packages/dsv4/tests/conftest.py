import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4Config

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
