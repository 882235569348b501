import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4Config
from ttnpu.dsv4.attention import Attention
from ttnpu.dsv4.backends.masks import visible_entries, window_mask
from ttnpu.dsv4.backends.selection import picks_mask, select_topk
from ttnpu.dsv4.compressor import Compressor
from ttnpu.dsv4.rope import RopeTable, rope_frequencies


def _attention(config: DeepSeekV4Config, ratio: int) -> Attention:
    attn = Attention(config, ratio)
    attn.reset_parameters(0.2)
    with torch.no_grad():
        attn.attn_sink.normal_()
        if attn.compressor is not None:
            attn.compressor.ape.normal_()
    return attn


def _rope(config: DeepSeekV4Config, seq_len: int) -> RopeTable:
    return RopeTable.build(
        rope_frequencies(config.rope_head_dim, 1e4), seq_len, torch.device("cpu")
    )


@pytest.mark.parametrize("ratio", [0, 4, 8], ids=["swa", "csa", "hca"])
@pytest.mark.parametrize("seq_len", [23, 37])
def test_changing_token_j_never_changes_earlier_outputs(
    tiny: DeepSeekV4Config, ratio: int, seq_len: int
) -> None:
    attn = _attention(tiny, ratio)
    rope = _rope(tiny, seq_len)
    x = torch.randn(1, seq_len, tiny.dim)
    base = attn(x, rope)[0]
    for j in range(0, seq_len, 3):
        x2 = x.clone()
        x2[:, j] += torch.randn(tiny.dim)
        out = attn(x2, rope)[0]
        assert torch.equal(out[:, :j], base[:, :j]), f"position < {j} changed"
        assert not torch.allclose(out[:, j], base[:, j])


def test_csa_with_topk_covering_every_entry_equals_dense_compressed_attention(
    tiny: DeepSeekV4Config,
) -> None:
    seq_len = 30  # 7 entries at m = 4; topk 3 is sparse, topk 7 is dense
    attn = _attention(tiny, 4)
    assert attn.indexer is not None
    rope = _rope(tiny, seq_len)
    x = torch.randn(2, seq_len, tiny.dim)
    attn.indexer.topk = 7
    with_indexer = attn(x, rope)[0]
    indexer, attn.indexer = attn.indexer, None  # dense: every visible entry, as in HCA
    dense = attn(x, rope)[0]
    torch.testing.assert_close(with_indexer, dense, atol=1e-6, rtol=1e-5)
    attn.indexer = indexer
    indexer.topk = 3
    assert not torch.allclose(attn(x, rope)[0], dense)


def test_indexer_selects_top_k_of_the_visible_entries_only(tiny: DeepSeekV4Config) -> None:
    attn = _attention(tiny, 4)
    assert attn.indexer is not None
    x, seq_len = torch.randn(1, 33, tiny.dim), 33
    qr = attn.q_norm(attn.wq_a(x))
    factors = attn.indexer(x, qr, _rope(tiny, seq_len))
    picks = select_topk(factors, 0, 4, select_logits=1 << 20)
    reads = picks_mask(picks, 8)[0]
    visible = visible_entries(seq_len, 8, 4, x.device)
    assert not (reads & ~visible).any()
    assert torch.equal(reads.sum(-1), visible.sum(-1).clamp(max=tiny.index_topk))
    assert torch.equal((picks[0] >= 0).sum(-1), reads.sum(-1))  # no pick twice


def test_window_sees_exactly_min_t_plus_1_and_window_tokens(tiny: DeepSeekV4Config) -> None:
    mask = window_mask(300, 128, torch.device("cpu"))
    assert torch.equal(mask.sum(-1), (torch.arange(300) + 1).clamp(max=128))
    assert mask[:, -1].all()  # the last slot is the query's own token
    attn, seq_len, j = _attention(tiny, 0), 30, 5  # window 8
    x = torch.randn(1, seq_len, tiny.dim)
    x2 = x.clone()
    x2[:, j] += 1.0
    changed = (
        (attn(x, _rope(tiny, seq_len))[0] - attn(x2, _rope(tiny, seq_len))[0]).abs().amax(-1)[0]
    )
    assert (changed > 0).nonzero().flatten().tolist() == list(range(j, j + tiny.window_size))


def test_compressed_entry_visibility_and_trailing_block() -> None:
    visible = visible_entries(10, 2, 4, torch.device("cpu"))
    assert visible.sum(-1).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]  # s < (t + 1) // 4
    comp = Compressor(16, 8, 4, overlap=True, eps=1e-6)
    comp.reset_parameters(0.1)
    rope = RopeTable.build(rope_frequencies(4, 1e4), 11, torch.device("cpu"))
    assert comp(torch.randn(1, 11, 16), rope).shape == (1, 2, 8)  # 3 trailing tokens dropped
    assert comp(torch.randn(1, 3, 16), rope).shape == (1, 0, 8)


def test_sink_absorbs_probability_mass(tiny: DeepSeekV4Config) -> None:
    attn = _attention(tiny, 0)
    rope = _rope(tiny, 12)
    x = torch.randn(1, 12, tiny.dim)
    with torch.no_grad():
        attn.attn_sink.fill_(-float("inf"))
        no_sink = attn(x, rope)[0]
        attn.attn_sink.fill_(50.0)  # the sink takes (almost) all the mass: zero value
        full_sink = attn(x, rope)[0]
    assert no_sink.abs().mean() > 1e3 * full_sink.abs().mean()


def test_bf16_activations_take_the_softmax_and_sink_in_fp32(
    tiny: DeepSeekV4Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    attn = _attention(tiny, 0)
    for linear in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b):
        linear.to(torch.bfloat16)  # a bf16 model; the sink parameter stays fp32
    with torch.no_grad():
        attn.attn_sink.fill_(1.0 + 2.0**-12)  # not representable in bf16
    softmax_inputs: list[torch.Tensor] = []
    softmax = torch.softmax

    def spy(x: torch.Tensor, dim: int) -> torch.Tensor:
        softmax_inputs.append(x)
        return softmax(x, dim=dim)

    monkeypatch.setattr(torch, "softmax", spy)
    out = attn(torch.randn(1, 12, tiny.dim, dtype=torch.bfloat16), _rope(tiny, 12))[0]
    assert out.dtype == torch.bfloat16
    (logits,) = softmax_inputs
    assert logits.dtype == torch.float32
    assert (logits[..., -1] == 1.0 + 2.0**-12).all()  # the sink logit, unrounded
