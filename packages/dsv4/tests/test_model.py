import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config


def test_debug_model_loss_falls_on_a_fixed_batch() -> None:
    config = DeepSeekV4Config.from_flavor("debug")
    model = DeepSeekV4(config)
    tokens = torch.randint(0, config.vocab_size, (1, 96))
    labels = torch.roll(tokens, -1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model.loss(tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_init_weights_is_deterministic_under_manual_seed(tiny: DeepSeekV4Config) -> None:
    torch.manual_seed(3)
    a = DeepSeekV4(tiny)
    b = DeepSeekV4(tiny)
    assert not torch.equal(a.embed.weight, b.embed.weight)
    torch.manual_seed(3)
    a.init_weights()
    torch.manual_seed(3)
    b.init_weights()
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("seq_len", [21, 34])
def test_whole_model_is_causal(tiny: DeepSeekV4Config, seq_len: int) -> None:
    model = DeepSeekV4(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (1, seq_len))
    base = model(tokens)
    assert base.shape == (1, seq_len, tiny.vocab_size)
    for j in (0, 7, seq_len - 1):
        changed = tokens.clone()
        changed[0, j] = (changed[0, j] + 1) % tiny.vocab_size
        out = model(changed)
        # Earlier positions may differ only by matmul rounding: routing token j elsewhere
        # changes the experts' group sizes, hence the BLAS blocking of other rows.
        torch.testing.assert_close(out[:, :j], base[:, :j], atol=1e-5, rtol=1e-5)
        assert (out[:, j] - base[:, j]).abs().max() > 1e-3


def test_loss_is_main_plus_weighted_mtp_balance_and_indexer_terms(
    tiny: DeepSeekV4Config,
) -> None:
    tokens = torch.randint(0, tiny.vocab_size, (2, 16))
    labels = torch.roll(tokens, -1, 1)
    torch.manual_seed(1)
    plain = DeepSeekV4(tiny.replace(n_mtp_layers=0, balance_loss_coef=0.0, indexer_loss_weight=0))
    main = torch.nn.functional.cross_entropy(plain(tokens).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(plain.loss(tokens, labels), main)
    torch.manual_seed(1)
    config = tiny.replace(
        n_mtp_layers=1, mtp_loss_weight=0.3, balance_loss_coef=0.5, indexer_loss_weight=0.7
    )
    full = DeepSeekV4(config)
    full.load_state_dict(plain.state_dict(), strict=False)
    terms = full.losses(tokens, labels)
    torch.testing.assert_close(terms.lm, main)
    assert terms.mtp > 3.0  # MTP CE ~ ln(97)
    assert terms.balance > 0 and terms.indexer > 0
    expected = terms.lm + 0.3 * terms.mtp + 0.5 * terms.balance + 0.7 * terms.indexer
    torch.testing.assert_close(terms.total, expected)
    torch.testing.assert_close(full.loss(tokens, labels), terms.total)
    labels[:, 5] = -100
    assert torch.isfinite(full.loss(tokens, labels))


def test_mtp_is_not_trained_where_its_input_label_is_ignored(tiny: DeepSeekV4Config) -> None:
    model = DeepSeekV4(tiny.replace(n_mtp_layers=1))
    tokens = torch.randint(0, tiny.vocab_size, (1, 16))
    labels = torch.roll(tokens, -1, 1)
    labels[0, 14] = -100  # position 14's MTP input is a placeholder; its target is labels[15]
    losses = []
    for target in range(4):
        labels[0, 15] = target  # also position 15's MTP input, whose own target is past the end
        with torch.no_grad():
            losses.append(model.losses(tokens, labels).mtp)
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], atol=1e-6, rtol=1e-6)


def test_bad_tokens_are_rejected(tiny: DeepSeekV4Config) -> None:
    model = DeepSeekV4(tiny)
    with pytest.raises(ValueError, match="LongTensor"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model.loss(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))


def test_meta_build_then_to_empty_and_init_weights_equals_an_eager_build(
    tiny: DeepSeekV4Config,
) -> None:
    config = tiny.replace(use_yarn=True, original_seq_len=16, rope_factor=4.0)
    eager = DeepSeekV4(config)
    with torch.device("meta"):
        lazy = DeepSeekV4(config)
    lazy.to_empty(device="cpu")
    for model in (eager, lazy):
        torch.manual_seed(5)
        model.init_weights()
    tokens = torch.randint(0, tiny.vocab_size, (1, 20))
    assert torch.equal(lazy(tokens), eager(tokens))
    for (name, a), (_, b) in zip(eager.named_buffers(), lazy.named_buffers(), strict=True):
        assert torch.equal(a, b), name
