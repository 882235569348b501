"""The npu backend against a recording fake of torch_npu: the exact operator calls (layouts, modes,
scale, page sizes, the key lists and selections passed, shapes, dtypes), and, with the fake
computing each operator's documented semantics in plain torch, the reference's function (every
loss term and parameter gradient, fp32). The last test runs the real operators on an Ascend
device (``-m npu``; skipped elsewhere)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.backends import AttentionInputs, IndexerInputs, attend, npu
from ttnpu.dsv4.backends.chunked import chunked_attention
from ttnpu.dsv4.backends.npu import NpuKernels, npu_attention
from ttnpu.dsv4.backends.selection import index_scores, select_topk
from ttnpu.dsv4.context_parallel import SequenceShard

TOLERANCE = 1e-5
WIDE = (torch.float32, torch.bfloat16, torch.float16)  # the fake computes fp32 too


def _rows(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``x`` [B, S, D] at ``at`` [B, s, K] -> [B, s, K, D]."""
    return x[torch.arange(x.shape[0]).view(-1, 1, 1), at.clamp_min(0)]


class FakeTorchNpu:
    """torch_npu's DSA operators as their documents state them (the subset of arguments the
    backend uses; anything else raises), in fp32 torch; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def npu_lightning_indexer(self, query: Any, key: Any, weights: Any, **kw: Any) -> Any:
        self.calls.append(
            ("npu_lightning_indexer", dict(query=query, key=key, weights=weights, **kw))
        )
        assert (kw["layout_query"], kw["layout_key"], kw["sparse_mode"]) == ("BSND", "PA_BSND", 3)
        assert query.shape[1] == 1 and kw["actual_seq_lengths_query"] is None
        paged = key[kw["block_table"].long()].flatten(1, 3)  # [R, pages * page, D]
        logits = torch.relu(query[:, 0].float() @ paged.float().transpose(1, 2))  # [R, N, S2]
        scores = (weights[:, 0, :, None].float() * logits).sum(1)
        beyond = torch.arange(scores.shape[1]) >= kw["actual_seq_lengths_key"].long()[:, None]
        top = scores.masked_fill(beyond, float("-inf")).topk(kw["sparse_count"], dim=-1)
        indices = top.indices.masked_fill(top.values.isneginf(), -1)
        return indices.to(torch.int32)[:, None, None], torch.empty(0)

    @staticmethod
    def _scores(query: Any, key: Any, indices: Any, scale: float, q_rope: Any, k_rope: Any) -> Any:
        at = indices[:, :, 0].long()  # [B, S1, K]
        assert not ((at[..., 1:] >= 0) & (at[..., :-1] < 0)).any(), "valid indices come first"
        keys, ropes = _rows(key[:, :, 0].float(), at), _rows(k_rope[:, :, 0].float(), at)
        scores = query.float() @ keys.transpose(-1, -2) + q_rope.float() @ ropes.transpose(-1, -2)
        valid = (at >= 0).unsqueeze(2)
        return (scores * scale).masked_fill(~valid, float("-inf")), keys, ropes, at, valid

    @staticmethod
    def _probs(scores: Any, softmax_max: Any, softmax_sum: Any) -> Any:
        return torch.exp(scores - softmax_max[:, 0, ..., None]) / softmax_sum[:, 0, ..., None]

    def npu_sparse_flash_attention(
        self, query: Any, key: Any, value: Any, sparse_indices: Any, scale_value: float, **kw: Any
    ) -> Any:
        args = dict(query=query, key=key, value=value, sparse_indices=sparse_indices)
        self.calls.append(("npu_sparse_flash_attention", dict(args, scale_value=scale_value, **kw)))
        assert value is key  # attention_mode 2: key and value share one tensor
        assert (kw["sparse_block_size"], kw["sparse_mode"], kw["attention_mode"]) == (1, 0, 2)
        assert kw["layout_query"] == kw["layout_kv"] == "BSND" and kw["return_softmax_lse"]
        scores, keys, *_ = self._scores(
            query, key, sparse_indices, scale_value, kw["query_rope"], kw["key_rope"]
        )
        softmax_max = scores.amax(dim=-1)
        exps = torch.exp(scores - softmax_max.unsqueeze(-1))
        softmax_sum = exps.sum(dim=-1)
        out = (exps / softmax_sum.unsqueeze(-1)) @ keys
        returned = out.to(query.dtype), softmax_max.unsqueeze(1), softmax_sum.unsqueeze(1)
        self.calls[-1][1]["returned"] = returned
        return returned

    def npu_sparse_flash_attention_grad(self, *args: Any, **kw: Any) -> Any:
        names = "query key value sparse_indices d_out out softmax_max softmax_sum scale_value"
        call = dict(zip([*names.split(), "sparse_block_size"], args, strict=True), **kw)
        self.calls.append(("npu_sparse_flash_attention_grad", call))
        query, key, value, indices, d_out, out, softmax_max, softmax_sum, scale = args[:9]
        assert value is key and args[9] == 1 and kw["layout"] == "BSND"
        assert (kw["sparse_mode"], kw["attention_mode"]) == (0, 2)
        q_rope, k_rope = kw["query_rope"].float(), kw["key_rope"]
        scores, keys, ropes, at, valid = self._scores(query, key, indices, scale, q_rope, k_rope)
        probs = self._probs(scores, softmax_max, softmax_sum).masked_fill(~valid, 0.0)
        d_out, out = d_out.float(), out.float()
        d_scores = probs * (d_out @ keys.transpose(-1, -2) - (d_out * out).sum(-1, keepdim=True))
        d_scores = d_scores * scale
        d_scores_t = d_scores.transpose(-1, -2)  # each listed key's rows: d_key, d_value, d_rope
        parts = (d_scores_t @ query.float(), probs.transpose(-1, -2) @ d_out, d_scores_t @ q_rope)
        d_rows = torch.cat(parts, dim=-1)
        grads = torch.zeros(*key.shape[:2], d_rows.shape[-1])
        batch = torch.arange(key.shape[0]).view(-1, 1, 1).expand_as(at)
        flat = (batch * key.shape[1] + at.clamp_min(0)).masked_fill(at < 0, 0).flatten()
        weight = (at >= 0).flatten().float().unsqueeze(-1)
        grads.view(-1, d_rows.shape[-1]).index_add_(0, flat, d_rows.flatten(0, 2) * weight)
        d_key, d_value, d_k_rope = grads.split([key.shape[-1], key.shape[-1], k_rope.shape[-1]], -1)
        return (
            (d_scores @ keys).to(query.dtype),
            d_key.unsqueeze(2).to(key.dtype),
            d_value.unsqueeze(2).to(key.dtype),
            (d_scores @ ropes).to(query.dtype),
            d_k_rope.unsqueeze(2).to(key.dtype),
        )

    def npu_sparse_lightning_indexer_grad_kl_loss(self, *args: Any, **kw: Any) -> Any:
        names = "query key query_index key_index weights sparse_indices softmax_max softmax_sum"
        call = dict(zip([*names.split(), "scale_value"], args, strict=True), **kw)
        self.calls.append(("npu_sparse_lightning_indexer_grad_kl_loss", call))
        query, key, query_index, key_index, weights, indices, softmax_max, softmax_sum, scale = args
        assert (kw["layout"], kw["sparse_mode"]) == ("BSND", 0)
        scores, _, _, at, valid = self._scores(
            query, key, indices, scale, kw["query_rope"], kw["key_rope"]
        )
        mass = self._probs(scores, softmax_max, softmax_sum).masked_fill(~valid, 0.0).sum(2)
        target = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        leaves = [t.detach().float().requires_grad_() for t in (query_index, key_index, weights)]
        with torch.enable_grad():
            keys = _rows(leaves[1][:, :, 0], at)  # [B, S1, K, D]
            logits = torch.relu(leaves[0] @ keys.transpose(-1, -2))  # [B, S1, N, K]
            index = (leaves[2].unsqueeze(-1) * logits).sum(2)
            index = index.masked_fill(~valid[:, :, 0], torch.finfo(torch.float32).min)
            kl = torch.xlogy(target, target) - target * index.log_softmax(dim=-1)
            loss = kl.sum()
            grads = torch.autograd.grad(loss, leaves)
        dtypes = (query_index.dtype, key_index.dtype, weights.dtype)
        return (*(g.to(d) for g, d in zip(grads, dtypes, strict=True)), loss.detach().view(1))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def fake() -> FakeTorchNpu:
    return FakeTorchNpu()


# The operators' shapes: head dim 512 (64 of it rotary), an indexer of 64 heads of 128.
FUSED: dict[str, Any] = dict(head_dim=512, rope_head_dim=64, index_n_heads=64, index_head_dim=128)
LAYERS: dict[str, dict[str, Any]] = {
    "window": dict(compress_ratios=(0, 0)),
    "csa": dict(compress_ratios=(0, 4)),
    "csa-dense": dict(compress_ratios=(0, 4), indexer_stage="dense"),
    "hca": dict(compress_ratios=(0, 8)),
    "mixed": dict(compress_ratios=(4, 8)),
    # The attention fused, the indexer too small for its operators: chunked selection and KL.
    "csa-small-indexer": dict(compress_ratios=(0, 4), index_n_heads=2, index_head_dim=64),
}


@pytest.mark.parametrize("layers", list(LAYERS))
def test_npu_backend_equals_reference_through_the_fake(
    layers: str,
    fake: FakeTorchNpu,
    monkeypatch: pytest.MonkeyPatch,
    matches_reference: Callable[..., torch.Tensor],
) -> None:
    """fp32 (the fake widens the operators' dtypes), MTP on, 37 tokens, key lists in chunks of
    a few queries."""
    monkeypatch.setattr(npu, "_kernels_for", lambda device: NpuKernels(fake, dtypes=WIDE))
    fields = dict(n_layers=2, n_mtp_layers=1, index_topk=3, attention_chunk_logits=64)
    config = DeepSeekV4Config.from_flavor("micro").replace(**fields, **FUSED | LAYERS[layers])
    tokens = torch.randint(0, config.vocab_size, (2, 37))
    want = matches_reference(config.replace(attention_backend="npu"), tokens, TOLERANCE)
    called = set(fake.names())
    assert "npu_sparse_flash_attention" in called
    # In the dense warm-up only the indexer trains: no attention backward.
    assert ("npu_sparse_flash_attention_grad" in called) == (layers != "csa-dense")
    fused_indexer = layers in ("csa", "mixed")
    assert ("npu_lightning_indexer" in called) == fused_indexer
    assert ("npu_sparse_lightning_indexer_grad_kl_loss" in called) == fused_indexer
    assert (want[4] > 0) == ("csa" in layers or layers == "mixed")


def _inputs(
    dtype: torch.dtype, *, start: int = 0, topk: int = 3, sparse: bool = True
) -> AttentionInputs:
    """A CSA layer's attention inputs at the operators' shapes: 2 x 13 queries (a slice at
    ``start`` of a longer sequence), 2 heads, window 4."""
    torch.manual_seed(2)
    length, window, heads, ratio = 13, 4, 2, 4
    n = (start + length) // ratio
    shard = SequenceShard(((0, start), (start, start + length)), rank=1) if start else None
    leaves = [
        torch.randn(2, length, heads, 512) / 8,
        torch.randn(2, window - 1 + length, 512) / 8,
        torch.randn(heads),
        torch.randn(2, n, 512) / 8,
        torch.randn(2, length, 64, 128) / 8,
        torch.randn(2, n, 128),
        torch.randn(2, length, 64) / 8,
    ]
    q, keys, sink, entries, iq, ik, iw = [t.to(dtype).requires_grad_() for t in leaves[:4]] + [
        t.requires_grad_() for t in leaves[4:]
    ]
    return AttentionInputs(
        q=q,
        keys=keys,
        window=window,
        sink=sink.float().detach().requires_grad_(),
        scale=512**-0.5,
        shard=shard or SequenceShard.whole(length),
        entries=entries,
        ratio=ratio,
        indexer=IndexerInputs(iq, ik, iw, topk, sparse=sparse),
        chunk_logits=6 * (window + topk),  # six queries a call: three calls
    )


def _valid_prefix(indices: torch.Tensor) -> list[list[set[int]]]:
    """The valid (>= 0) entries of each row, checked to come first."""
    rows = indices[:, :, 0].tolist()
    out = []
    for batch in rows:
        sets = []
        for row in batch:
            valid = [i for i in row if i >= 0]
            assert row[: len(valid)] == valid and all(i == -1 for i in row[len(valid) :])
            sets.append(set(valid))
        out.append(sets)
    return out


@pytest.mark.parametrize("start", [0, 9])
def test_the_operator_calls(start: int, fake: FakeTorchNpu) -> None:
    """bf16, the operators' own dtypes: the exact sequence and arguments of every call."""
    inputs = _inputs(torch.bfloat16, start=start)
    ix = inputs.indexer
    assert ix is not None and inputs.entries is not None
    batch, length, heads, _ = inputs.q.shape
    n, window, k = inputs.entries.shape[1], inputs.window, 3
    out, loss = npu_attention(inputs, NpuKernels(fake))
    assert loss is not None and out.dtype == torch.bfloat16 and out.shape == inputs.q.shape
    forward = fake.names()
    assert forward == ["npu_lightning_indexer"] + ["npu_sparse_flash_attention"] * 3 + [
        "npu_sparse_lightning_indexer_grad_kl_loss"
    ]
    d_out = torch.randn_like(out)
    torch.autograd.backward((out, loss), (d_out, torch.tensor(1.0)))
    assert fake.names()[len(forward) :] == ["npu_sparse_flash_attention_grad"] * 3

    # The indexer: one query per batch row, the entries paged (one 16-row page), each row's
    # key length its visible count.
    li = fake.calls[0][1]
    visible = ((torch.arange(start, start + length) + 1) // 4).clamp(max=n)
    assert li["query"].shape == (batch * length, 1, 64, 128)
    assert li["query"].dtype == li["key"].dtype == li["weights"].dtype == torch.bfloat16
    assert li["key"].shape == (batch, 16, 1, 128) and li["weights"].shape == (batch * length, 1, 64)
    assert torch.equal(li["key"][:, :n, 0].float(), ix.keys.detach().bfloat16().float())
    assert li["actual_seq_lengths_key"].dtype == torch.int32
    assert li["actual_seq_lengths_key"].tolist() == visible.tolist() * batch
    assert li["block_table"].dtype == torch.int32
    assert li["block_table"].tolist() == [[0]] * length + [[1]] * length
    assert li["sparse_count"] == k and li["return_value"] is False
    picks = fake.calls[4][1]["sparse_indices"][:, :, 0].long()  # [B, L, k], as the KL got them

    # Attention: each query lists its valid window slots and its picks among [keys, entries].
    offset = window - 1 + length
    calls = [c for name, c in fake.calls if name == "npu_sparse_flash_attention"]
    assert [c["query"].shape[1] for c in calls] == [6, 6, 1]
    got_rows = [row for c in calls for row in zip(*_valid_prefix(c["sparse_indices"]), strict=True)]
    for c in calls:
        assert c["key"].shape == (batch, offset + n, 1, 512) and c["key"].dtype == torch.bfloat16
        assert c["sparse_indices"].dtype == torch.int32
        assert c["sparse_indices"].shape[2:] == (1, window + k)
        assert c["scale_value"] == inputs.scale
        assert c["query_rope"].shape == (*c["query"].shape[:3], 64) and not c["query_rope"].any()
        assert c["key_rope"].shape == (batch, offset + n, 1, 64) and not c["key_rope"].any()
    for t, rows in enumerate(got_rows):
        for b, row in enumerate(rows):
            slots = {t + w for w in range(window) if start + t - window + 1 + w >= 0}
            chosen = {offset + int(p) for p in picks[b, t] if p >= 0}
            assert row == slots | chosen
            assert all(int(p) < visible[t] for p in picks[b, t] if p >= 0)

    # The KL: the main attention's softmax statistics, the sink added to each row's sum.
    kl = fake.calls[4][1]
    assert kl["query"].shape == (batch, length, heads, 512) and kl["key"].shape == (
        batch,
        n,
        1,
        512,
    )
    assert kl["query_index"].shape == (batch, length, 64, 128)
    assert kl["key_index"].shape == (batch, n, 1, 128) and kl["weights"].shape == (
        batch,
        length,
        64,
    )
    assert kl["sparse_indices"].dtype == torch.int32 and kl["sparse_indices"].shape == (
        batch,
        length,
        1,
        k,
    )
    maxima = torch.cat([c["returned"][1] for c in calls], dim=2)
    sums = torch.cat([c["returned"][2] for c in calls], dim=2)
    assert kl["softmax_max"].dtype == torch.float32 and torch.equal(kl["softmax_max"], maxima)
    torch.testing.assert_close(kl["softmax_sum"], sums + torch.exp(inputs.sink.detach() - maxima))
    assert kl["scale_value"] == inputs.scale

    # Backward: d_out is the output's gradient times sigmoid(lse - sink), out the gated output.
    grad_calls = [c for name, c in fake.calls if name == "npu_sparse_flash_attention_grad"]
    first = grad_calls[0]  # the last chunk's, the backward runs in reverse
    lse = (maxima + sums.log())[:, 0, -1:]
    gate = torch.sigmoid(lse - inputs.sink.detach())
    torch.testing.assert_close(
        first["d_out"].float(), (d_out[:, -1:].float() * gate[..., None]).bfloat16().float()
    )
    torch.testing.assert_close(first["out"].float(), out[:, -1:].detach().float())
    assert first["sparse_block_size"] == 1 and first["scale_value"] == inputs.scale


@pytest.mark.parametrize("start", [0, 9])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_attention_equals_reference_through_the_fake(
    start: int, sparse: bool, fake: FakeTorchNpu
) -> None:
    """fp32 through the fake; a context-parallel slice too (halo and absolute positions)."""
    inputs = _inputs(torch.float32, start=start, sparse=sparse)
    ix, entries = inputs.indexer, inputs.entries
    assert ix is not None and entries is not None
    leaves = [inputs.q, inputs.keys, inputs.sink, entries, ix.q, ix.keys, ix.weights]
    results = []
    for run in (
        lambda: attend("reference", inputs),
        lambda: npu_attention(inputs, NpuKernels(fake, dtypes=WIDE)),
    ):
        out, loss = run()
        assert loss is not None
        grads = torch.autograd.grad((out * out.detach()).sum() + loss, leaves)
        results.append((out, loss, grads))
    (want, want_loss, want_grads), (got, got_loss, got_grads) = results
    assert "npu_sparse_flash_attention_grad" in fake.names()
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(got_loss, want_loss, rtol=TOLERANCE, atol=TOLERANCE)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert (got_grad - want_grad).abs().max() / want_grad.abs().max().clamp_min(
            1e-3
        ) < TOLERANCE


def test_what_the_operators_cannot_take_runs_chunked(fake: FakeTorchNpu) -> None:
    """fp32 activations (the operators take bf16 / fp16) and head dims other than 512."""
    inputs = _inputs(torch.float32)
    torch.testing.assert_close(
        npu_attention(inputs, NpuKernels(fake)), chunked_attention(inputs), rtol=0, atol=0
    )
    assert fake.calls == []


@pytest.fixture
def no_cached_kernels() -> Any:
    npu._torch_npu_kernels.cache_clear()
    yield
    npu._torch_npu_kernels.cache_clear()


@pytest.mark.usefixtures("no_cached_kernels")
def test_without_torch_npu_the_backend_says_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    config = DeepSeekV4Config.from_flavor("micro").replace(attention_backend="npu")
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    with pytest.raises(RuntimeError) as err:
        DeepSeekV4(config).loss(tokens, tokens)
    assert str(err.value) == npu.MISSING
    assert str(err.value).startswith("attention_backend='npu' needs torch_npu (pip install")


@pytest.mark.usefixtures("no_cached_kernels")
def test_tensors_off_the_npu_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNpu())
    with pytest.raises(
        RuntimeError, match=r"needs torch_npu .* and an Ascend device; got cpu tensors$"
    ):
        attend("npu", _inputs(torch.bfloat16))


def _on_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def _moved(inputs: AttentionInputs, device: str, **changes: Any) -> AttentionInputs:
    """``inputs`` (with ``changes``) as fresh leaves on ``device``."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device).requires_grad_()

    inputs = dataclasses.replace(inputs, **changes)
    ix = inputs.indexer
    return dataclasses.replace(
        inputs,
        q=leaf(inputs.q),
        keys=leaf(inputs.keys),
        sink=leaf(inputs.sink),
        entries=None if inputs.entries is None else leaf(inputs.entries),
        indexer=None
        if ix is None
        else IndexerInputs(leaf(ix.q), leaf(ix.keys), leaf(ix.weights), ix.topk, ix.sparse),
    )


@pytest.mark.npu
@pytest.mark.skipif(not _on_npu(), reason="needs torch_npu and an Ascend device")
@pytest.mark.parametrize("case", ["window", "hca", "csa-all", "csa-dense"])
def test_npu_operators_for_real(case: str) -> None:
    """bf16 on the device against the reference on the same bf16 inputs (its softmax in fp32):
    output, indexer loss and every input gradient within bf16 rounding. ``csa-all``: top-k
    covers every entry, so the selection is tie-free; the top-k proper is checked below."""
    topk = 64 if case == "csa-all" else 3
    inputs = _inputs(torch.bfloat16, start=9, topk=topk, sparse=case != "csa-dense")
    changes: dict[str, Any] = {}
    if case == "window":
        changes = dict(entries=None, indexer=None, ratio=0)
    elif case == "hca":
        changes = dict(indexer=None)
    results = []
    for backend, device in (("reference", "cpu"), ("npu", "npu")):
        run = _moved(inputs, device, **changes)
        out, loss = attend(backend, run)  # type: ignore[arg-type]
        leaves = [t for t in (run.q, run.keys, run.sink, run.entries) if t is not None]
        if run.indexer is not None:
            leaves += [run.indexer.q, run.indexer.keys, run.indexer.weights]
        total = (out.float() * out.detach().float()).sum() + (0 if loss is None else loss)
        results.append([out, loss, *torch.autograd.grad(total, leaves)])
    for want, got in zip(*results, strict=True):
        if want is not None:
            scale = want.float().abs().max().clamp_min(1e-2)
            assert (got.cpu().float() - want.float()).abs().max() <= 2e-2 * scale


@pytest.mark.npu
@pytest.mark.skipif(not _on_npu(), reason="needs torch_npu and an Ascend device")
def test_npu_lightning_indexer_picks_the_top_k() -> None:
    """The operator's picks score the top-k of the visible entries (ties may differ)."""
    inputs = _moved(_inputs(torch.bfloat16, start=9, topk=3), "npu")
    ix = inputs.indexer
    assert ix is not None
    picks = npu._select(inputs, npu._kernels_for(inputs.q.device)).cpu()
    rounded = [t.detach().cpu().bfloat16().float() for t in (ix.q, ix.keys, ix.weights)]
    want = select_topk(IndexerInputs(rounded[0], rounded[1], rounded[2], 3, True), 9, 4, 1 << 20)
    scores = index_scores(rounded[0], rounded[2], rounded[1])
    assert torch.equal((picks >= 0).sum(-1), (want >= 0).sum(-1))
    got_scores = scores.gather(-1, picks.clamp_min(0)).masked_fill(picks < 0, 0).sort(-1).values
    want_scores = scores.gather(-1, want.clamp_min(0)).masked_fill(want < 0, 0).sort(-1).values
    torch.testing.assert_close(got_scores, want_scores, rtol=2e-2, atol=2e-2)
