"""The flex backend computes the reference's function: every loss term and every parameter
gradient, fp32, on every layer type.

On CUDA (skipped elsewhere) the backend runs as configured: compiled flex_attention and
create_block_mask. On a CPU it refuses; the same code is also checked there through flex's own
eager implementation (its dense math, forward and backward), with torch's CPU guard lifted for
the test. Self-contained: ``uv run pytest packages/dsv4/tests/test_backend_flex.py`` on a CUDA
machine runs the real thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.backends import AttentionInputs, IndexerInputs, attend, flex
from ttnpu.dsv4.context_parallel import SequenceShard

LAYERS: dict[str, dict[str, Any]] = {
    "window": dict(compress_ratios=(0, 0)),
    "csa": dict(compress_ratios=(0, 4)),
    "csa-dense": dict(compress_ratios=(0, 4), indexer_stage="dense"),
    "hca": dict(compress_ratios=(0, 8)),
    "mixed": dict(compress_ratios=(4, 8)),
}
TOLERANCE = 1e-5


def _config(layers: str, **changes: object) -> DeepSeekV4Config:
    return DeepSeekV4Config.from_flavor("micro").replace(
        n_layers=2, n_mtp_layers=1, index_topk=3, **LAYERS[layers], **changes
    )


def _assert_matches_reference(
    check: Callable[..., torch.Tensor], layers: str, seq_len: int, device: torch.device
) -> None:
    config = _config(layers, attention_backend="flex")
    tokens = torch.randint(0, config.vocab_size, (2, seq_len), device=device)
    want = check(config, tokens, TOLERANCE)
    assert (want[4] > 0) == (layers in ("csa", "csa-dense", "mixed"))  # the indexer KL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flex backend needs CUDA")
@pytest.mark.parametrize("layers", list(LAYERS))
@pytest.mark.parametrize("seq_len", [37, 300])
def test_flex_equals_reference_on_cuda(
    layers: str, seq_len: int, matches_reference: Callable[..., torch.Tensor]
) -> None:
    """Compiled flex (Triton); 300 tokens span several 128-blocks of queries and keys."""
    _assert_matches_reference(matches_reference, layers, seq_len, torch.device("cuda"))


@pytest.fixture
def eager_flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend through flex's eager implementation, with its CPU guard lifted."""
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(flex, "flex_attention_backend", flex.flex_attention_core)


@pytest.mark.usefixtures("eager_flex_on_cpu")
@pytest.mark.parametrize("layers", list(LAYERS))
def test_flex_math_equals_reference_on_cpu(
    layers: str, matches_reference: Callable[..., torch.Tensor]
) -> None:
    """The mask (window, visibility, the binary search over the picks), the sink from the
    log-sum-exp and the KL from it, forward and backward, through flex's dense math."""
    _assert_matches_reference(matches_reference, layers, 37, torch.device("cpu"))


@pytest.mark.usefixtures("eager_flex_on_cpu")
@pytest.mark.parametrize(("start", "dim"), [(0, 16), (21, 16), (21, 128)])
def test_flex_math_equals_reference_on_a_slice(start: int, dim: int) -> None:
    """A context-parallel slice (window halo, absolute positions), more picks than a power of
    two, and a query that reads nothing but its window; fp32 heads of 128 pass wide-head
    ``kernel_options`` to flex."""
    torch.manual_seed(1)
    length, window, heads, ratio = 19, 5, 3, 4
    n = (start + length) // ratio
    shard = SequenceShard(((0, start), (start, start + length)), rank=1) if start else None
    leaves = [
        torch.randn(2, length, heads, dim),
        torch.randn(2, window - 1 + length, dim),
        torch.randn(heads),
        torch.randn(2, n, dim),
        torch.randn(2, length, 2, 8),
        torch.randn(2, n, 8),
        torch.randn(2, length, 2),
    ]
    for leaf in leaves:
        leaf.requires_grad_()
    q, keys, sink, entries, index_q, index_keys, index_weights = leaves
    results = {}
    for backend in ("reference", "flex"):
        inputs = AttentionInputs(
            q=q,
            keys=keys,
            window=window,
            sink=sink,
            scale=0.25,
            shard=shard or SequenceShard.whole(length),
            entries=entries,
            ratio=ratio,
            indexer=IndexerInputs(index_q, index_keys, index_weights, 5, sparse=True),
        )
        out, loss = attend(backend, inputs)
        assert loss is not None
        grads = torch.autograd.grad((out * out.detach()).sum() + loss, leaves)
        results[backend] = (out, loss, grads)
    (out, loss, grads), (want_out, want_loss, want_grads) = results["flex"], results["reference"]
    torch.testing.assert_close(out, want_out, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(loss, want_loss, rtol=TOLERANCE, atol=TOLERANCE)
    for got, want in zip(grads, want_grads, strict=True):
        assert (got - want).abs().max() / want.abs().max().clamp_min(1e-3) < TOLERANCE


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(256, torch.bfloat16), (128, torch.float32), (512, torch.bfloat16), (512, torch.float32)],
)
def test_wide_heads_get_forward_tiles_that_fit_shared_memory(
    head_dim: int, dtype: torch.dtype
) -> None:
    """Rows wider than 256 bytes (Inductor's defaults asked 254,080 bytes of the 232,448 an H200
    SM has for fp32 heads of 128): tiles that divide the block mask's 128-blocks, within the
    shared-memory budget; the defaults stay where they fit."""
    options = flex.kernel_options(head_dim, dtype)
    assert options is not None
    m, n, stages = options["BLOCK_M"], options["BLOCK_N"], options["num_stages"]
    assert 128 % m == 0 and 128 % n == 0 and 1 <= stages <= 3
    assert head_dim * dtype.itemsize * (m + 2 * stages * n) <= 160 * 1024
    assert flex.kernel_options(128, torch.bfloat16) is None
    assert flex.kernel_options(64, torch.float32) is None


def test_heads_too_wide_for_one_stage_are_refused() -> None:
    with pytest.raises(ValueError, match=r"heads of 1024 x torch.float32 \(4096 bytes a row\)"):
        flex.kernel_options(1024, torch.float32)


def test_flex_refuses_a_cpu() -> None:
    config = _config("csa", attention_backend="flex")
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    with pytest.raises(
        ValueError, match=r"^attention_backend='flex' needs a CUDA device; got cpu$"
    ):
        DeepSeekV4(config).loss(tokens, tokens)
