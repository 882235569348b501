"""The chunked attention backend computes the reference's function: every loss term and every
parameter gradient on every layer type, at lengths that are multiples of no block size, with one
chunk or many; its top-k selection is the full-row top-k; and it keeps no tensor that grows with
``S x S/m`` for the backward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4Config
from ttnpu.dsv4.attention import Attention
from ttnpu.dsv4.backends import IndexerInputs, chunked
from ttnpu.dsv4.backends.selection import index_scores, picks_mask, select_topk
from ttnpu.dsv4.rope import RopeTable, rope_frequencies

CASES = {
    "window": dict(compress_ratios=(0, 0, 0, 0)),
    "csa": dict(compress_ratios=(0, 4, 0, 4)),
    "csa-dense": dict(compress_ratios=(0, 4, 0, 4), indexer_stage="dense"),
    "hca": dict(compress_ratios=(0, 8, 0, 8)),
    "mixed": dict(compress_ratios=(0, 4, 8, 4)),
    "mixed-yarn": dict(
        compress_ratios=(0, 4, 8, 4), use_yarn=True, rope_factor=4.0, original_seq_len=16
    ),
}
TOLERANCE = 1e-5


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seq_len", [37, 70])
@pytest.mark.parametrize("chunk_logits", [1 << 24, 96], ids=["one-chunk", "many-chunks"])
def test_chunked_equals_reference(
    case: str, seq_len: int, chunk_logits: int, matches_reference: Callable[..., torch.Tensor]
) -> None:
    """fp32, relative to each gradient's largest entry; MTP on. With 96 logits a chunk holds
    one to five queries and the indexer (selecting within the same budget) scores key blocks of
    8 entries: both loops run."""
    config = DeepSeekV4Config.from_flavor("micro").replace(
        n_mtp_layers=1,
        index_topk=3,
        attention_chunk_logits=chunk_logits,
        index_select_logits=chunk_logits,
        **CASES[case],
    )
    tokens = torch.randint(0, config.vocab_size, (2, seq_len))
    want = matches_reference(config, tokens, TOLERANCE)
    assert want[0] > 1 and (want[4] > 0) == ("csa" in case or "mixed" in case)


@pytest.mark.parametrize("chunk_logits", [1 << 24, 2000], ids=["one-chunk", "many-chunks"])
def test_csa_gathered_and_masked_picks_are_the_same_function(
    chunk_logits: int,
    matches_reference: Callable[..., torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CSA chunks gather their picks once the visible entries outnumber what gathering holds
    (here 31 entries: 124 tokens); before, they mask. At 203 tokens one chunk gathers; with
    2000 logits a chunk (10 queries) the first chunks mask and the last ones gather."""
    config = DeepSeekV4Config.from_flavor("micro").replace(
        compress_ratios=(0, 4), n_layers=2, index_topk=3, attention_chunk_logits=chunk_logits
    )
    gathers = []
    gather = chunked.gather_picked
    monkeypatch.setattr(chunked, "gather_picked", lambda *a: gathers.append(1) or gather(*a))
    monkeypatch.setattr(chunked, "picks_mask", lambda *a: gathers.append(0) or picks_mask(*a))
    tokens = torch.randint(0, config.vocab_size, (2, 203))
    matches_reference(config, tokens, TOLERANCE)
    assert 1 in gathers and (0 in gathers) == (chunk_logits == 2000)


def _indexer_inputs(length: int, n: int, topk: int, heads: int = 2) -> IndexerInputs:
    q = torch.randn(2, length, heads, 8)
    keys = torch.randn(2, n, 8)
    keys[:, ::3] = 0.0  # ties at exactly zero, as relu makes them
    return IndexerInputs(q, keys, torch.randn(2, length, heads), topk, sparse=True)


@pytest.mark.parametrize("chunk_logits", [1 << 20, 40, 7])
@pytest.mark.parametrize("start", [0, 13])
def test_selection_is_the_full_row_top_k_of_the_visible_entries(
    chunk_logits: int, start: int
) -> None:
    length, n, ratio, topk = 41, 14, 4, 5
    ix = _indexer_inputs(length, n, topk)
    picks = select_topk(ix, start, ratio, chunk_logits)
    assert picks.shape == (2, length, topk)
    scores = index_scores(ix.q, ix.weights, ix.keys)
    visible = torch.arange(n) < ((torch.arange(start, start + length) + 1) // ratio)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    best = scores.topk(topk, dim=-1).values
    valid = picks >= 0
    assert torch.equal(valid.sum(-1), visible.sum(-1).clamp(max=topk).expand(2, -1))
    assert not (picks_mask(picks, n) & ~visible).any()  # never an entry not yet visible
    got = scores.gather(-1, picks.clamp_min(0)).masked_fill(~valid, float("-inf"))
    # Ties may be broken differently by block: the chosen scores are the top-k scores.
    torch.testing.assert_close(got.sort(-1, descending=True).values, best)
    assert (picks_mask(picks, n).sum(-1) == valid.sum(-1)).all()  # no entry twice


def _saved_storages(fn: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]) -> list[int]:
    """numel of each distinct storage autograd keeps from ``fn()`` for the backward."""
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes():
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.itemsize
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, loss = fn()
    (out.sum() + (0 if loss is None else loss)).backward()
    return list(sizes.values())


@pytest.mark.parametrize("ratio", [4, 8], ids=["csa", "hca"])
def test_chunked_keeps_nothing_that_grows_with_queries_times_entries(ratio: int) -> None:
    config = DeepSeekV4Config.from_flavor("micro").replace(index_topk=4)
    seq_len = 512
    attn = Attention(config, ratio)
    attn.reset_parameters(0.2)
    freqs = rope_frequencies(config.rope_head_dim, 1e4)
    rope = RopeTable.build(freqs, seq_len, torch.device("cpu"))
    x = torch.randn(1, seq_len, config.dim, requires_grad=True)
    n = seq_len // ratio
    largest = {}
    for backend in ("reference", "chunked"):
        attn.backend = backend
        largest[backend] = max(_saved_storages(lambda: attn(x, rope)))
    scores = seq_len * config.n_heads * n
    assert largest["reference"] >= scores  # the dense [S, H, N] probabilities
    # Chunked: the widest saved tensor is a per-token activation (q [S, H, D] at most).
    assert largest["chunked"] <= seq_len * max(config.n_heads * config.head_dim, config.dim)
    assert largest["chunked"] < scores
