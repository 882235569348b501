import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.attention import Attention
from ttnpu.dsv4.backends import reference
from ttnpu.dsv4.backends.masks import visible_entries
from ttnpu.dsv4.compressor import indexer_kl
from ttnpu.dsv4.context_parallel import SequenceShard
from ttnpu.dsv4.rope import RopeTable, rope_frequencies


def _grads(model: DeepSeekV4, tokens: torch.Tensor) -> dict[str, torch.Tensor | None]:
    model.loss(tokens, torch.roll(tokens, -1, 1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_indexer_kl_matches_a_per_row_reference_and_skips_rows_without_entries() -> None:
    index = torch.randn(2, 5, 6)
    mass = torch.rand(2, 5, 6)
    reads = torch.rand(2, 5, 6) > 0.4
    reads[0, 1] = False  # a query that reads nothing: left out of the mean
    reads[1, 2] = True
    kls = []
    for b in range(2):
        for t in range(5):
            row = reads[b, t]
            if row.any():
                p = torch.distributions.Categorical(probs=mass[b, t][row])
                q = torch.distributions.Categorical(logits=index[b, t][row])
                kls.append(torch.distributions.kl_divergence(p, q))
    torch.testing.assert_close(indexer_kl(index, mass, reads), torch.stack(kls).mean())


def test_indexer_kl_is_zero_iff_the_scores_reproduce_the_target() -> None:
    mass = torch.rand(2, 7, 5)
    reads = visible_entries(7, 5, 1, torch.device("cpu")).expand(2, -1, -1)
    # Scores equal log p up to a per-query constant; unread entries may hold anything (-inf here).
    index = (mass.log() + torch.randn(2, 7, 1)).masked_fill(~reads, float("-inf"))
    index.requires_grad_(True)
    loss = indexer_kl(index, mass, reads)
    loss.backward()
    assert abs(loss.item()) < 1e-6
    assert index.grad is not None and index.grad.abs().max() < 1e-6
    assert torch.isfinite(index.grad).all()
    assert indexer_kl(index.detach() + torch.randn(2, 7, 5), mass, reads) > 1e-3


def test_indexer_target_is_the_attention_mass_it_reads(
    tiny: DeepSeekV4Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense warm-up: the attention does not depend on the index scores, so scores equal to the
    log of the recorded target must give a zero loss from the same forward (the reference
    backend, which states the function; the others are tested equal to it)."""
    attn = Attention(tiny.replace(indexer_stage="dense", attention_backend="reference"), 4)
    attn.reset_parameters(0.2)
    assert attn.indexer is not None
    seq_len = 27
    rope = RopeTable.build(rope_frequencies(tiny.rope_head_dim, 1e4), seq_len, torch.device("cpu"))
    x = torch.randn(2, seq_len, tiny.dim)
    targets: list[torch.Tensor] = []

    def recording(
        index: torch.Tensor, mass: torch.Tensor, reads: torch.Tensor, shard: SequenceShard
    ) -> torch.Tensor:
        targets.append(mass.detach())
        return indexer_kl(index, mass, reads, shard)

    monkeypatch.setattr(reference, "indexer_kl", recording)
    out, loss = attn(x, rope)
    assert loss is not None and loss > 0
    mass = targets[0]
    visible = visible_entries(seq_len, seq_len // 4, 4, x.device)
    assert torch.equal(mass > 0, visible.expand_as(mass))  # every visible entry, nothing else
    assert (mass.sum(-1) < tiny.n_heads).all()  # summed over heads, shared with window and sink
    perfect = mass.clamp_min(1e-30).log().masked_fill(~visible, float("-inf"))
    monkeypatch.setattr(reference, "index_scores", lambda *args: perfect)
    out_again, zero = attn(x, rope)
    assert torch.equal(out_again, out)
    assert zero is not None and abs(zero.item()) < 1e-6


def test_model_loss_trains_the_indexer_only_through_its_loss(tiny: DeepSeekV4Config) -> None:
    """The indexer's gradient is exactly that of its KL; every other gradient is bit for bit the
    one without the indexer loss."""
    tokens = torch.randint(0, tiny.vocab_size, (2, 24))
    torch.manual_seed(1)
    without = DeepSeekV4(tiny.replace(indexer_loss_weight=0.0))
    state = without.state_dict()
    base = _grads(without, tokens)
    with_loss = DeepSeekV4(tiny.replace(indexer_loss_weight=0.5))
    with_loss.load_state_dict(state)
    grads = _grads(with_loss, tokens)
    kl_only = DeepSeekV4(tiny)
    kl_only.load_state_dict(state)
    kl_only.losses(tokens, torch.roll(tokens, -1, 1)).indexer.backward()
    indexer_params = [n for n in grads if ".indexer." in n]
    assert len(indexer_params) == 6 * sum(r == 4 for r in tiny.compress_ratios)
    for name, grad in grads.items():
        if ".indexer." in name:
            assert base[name] is None or not base[name].any(), name  # LM loss: no gradient
            assert grad is not None and grad.any(), name
            kl_grad = dict(kl_only.named_parameters())[name].grad
            assert kl_grad is not None
            torch.testing.assert_close(grad, 0.5 * kl_grad, rtol=1e-6, atol=0)
        else:
            assert grad is not None and torch.equal(grad, base[name]), name
            assert dict(kl_only.named_parameters())[name].grad is None, name


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_whole_model_stays_causal_in_both_indexer_stages(
    tiny: DeepSeekV4Config, stage: str
) -> None:
    model = DeepSeekV4(tiny.replace(indexer_stage=stage))
    seq_len = 29
    tokens = torch.randint(0, tiny.vocab_size, (1, seq_len))
    base = model(tokens)
    for j in (4, 13, seq_len - 1):
        changed = tokens.clone()
        changed[0, j] = (changed[0, j] + 1) % tiny.vocab_size
        out = model(changed)
        torch.testing.assert_close(out[:, :j], base[:, :j], atol=1e-5, rtol=1e-5)
        assert (out[:, j] - base[:, j]).abs().max() > 1e-3


def test_sparse_stage_with_top_k_covering_every_entry_equals_the_dense_stage(
    tiny: DeepSeekV4Config,
) -> None:
    tokens = torch.randint(0, tiny.vocab_size, (2, 30))
    labels = torch.roll(tokens, -1, 1)
    torch.manual_seed(2)
    dense = DeepSeekV4(tiny.replace(indexer_stage="dense"))
    sparse = DeepSeekV4(tiny.replace(index_topk=30 // 4))
    sparse.load_state_dict(dense.state_dict())
    a, b = dense.losses(tokens, labels), sparse.losses(tokens, labels)
    torch.testing.assert_close(a.indexer, b.indexer, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a.total, b.total, atol=1e-6, rtol=1e-5)
    truly_sparse = DeepSeekV4(tiny)  # index_topk 3 < 7 entries
    truly_sparse.load_state_dict(dense.state_dict())
    assert not torch.allclose(truly_sparse.losses(tokens, labels).indexer, a.indexer)


def test_dense_warm_up_lowers_the_indexer_loss_and_trains_nothing_else(
    tiny: DeepSeekV4Config,
) -> None:
    model = DeepSeekV4(tiny.replace(indexer_stage="dense"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, tiny.vocab_size, (2, 32))
    labels = torch.roll(tokens, -1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # every parameter offered
    history = []
    for _ in range(6):
        terms = model.losses(tokens, labels)
        terms.total.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append((terms.indexer.item(), terms.lm.item()))
    (first_kl, first_lm), (last_kl, last_lm) = history[0], history[-1]
    assert last_kl < 0.7 * first_kl, history
    assert last_lm == first_lm, history  # the main model did not move
    for name, param in model.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == (".indexer." in name), name
