"""tools/cp_memory_model.py: the context-parallel memory/communication model of ttnpu-dsv4.

Unit checks of ``predict`` (what must scale as 1/cp does, what must not does not, the Flash
figures at 1M tokens / CP 128 are the closed forms, for both attention backends and with full
activation checkpointing) and of the prediction against the bytes autograd really keeps on the
one-process micro model (every attention backend x AC mode, several query chunks); the e2e check
runs the debug model on real gloo processes for CP 1 and 2 (every backend x AC mode, fp32 and
bf16 weights) and requires every rank's bytes to be the predicted ones, every rank's CP traffic
(the recomputed blocks' included) to be the predicted traffic, and the memory to fall with CP and
with AC. ``tools/cp_memory_model.py --check`` adds CP 4 and the peaks of live bytes (~2.5 min).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config

TOOL = Path(__file__).resolve().parents[2] / "tools" / "cp_memory_model.py"

# Measured / predicted, per rank and degree. The model is closed-form but exact for this code:
# the MoE saves exactly T * top_k routed rows whatever the routing (one grouped matmul, no
# capacity padding), so no saved byte depends on the data; what it leaves out is a handful of
# scalars (loss denominators, counts): ~50 bytes. 1% leaves room for a changed op saving a few
# small extra tensors and still catches one more fp32 [L, dim] tensor per block (~1.4% of the
# debug model's total at 1001 tokens).
TOLERANCE = 0.01


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cp_memory_model", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


cpm = _load_tool()
FLASH = DeepSeekV4Config.from_flavor("flash")  # attention_backend "chunked", the default
REFERENCE = FLASH.replace(attention_backend="reference")
MILLION = 1 << 20

# Terms proportional to this rank's tokens (no halo, no gathered whole-sequence part), up to
# per-block constants of at most 2 KiB (the experts' group offsets, the mHC row scales).
PER_TOKEN = (
    "mhc_streams",
    "mhc_mixing",
    "window_probs",
    "entry_probs",
    "attention_output",
    "moe_routed",
    "moe_shared",
)


@pytest.mark.parametrize("config", [FLASH, REFERENCE], ids=["chunked", "reference"])
def test_per_token_terms_scale_as_one_over_cp_and_the_rest_does_not(
    config: DeepSeekV4Config,
) -> None:
    one = cpm.predict(config, MILLION, 1)
    for cp in (8, 128):
        split = cpm.predict(config, MILLION, cp)
        for term in PER_TOKEN:
            constants = cp * (config.n_layers + 1) * 2048  # per block: offsets, row scales
            assert split.terms[term] * cp == pytest.approx(one.terms[term], abs=constants), term
        # Every rank keeps all S / ratio entries (bf16, 512 wide): that part does not divide.
        gathered = sum(2 * (MILLION // r) * 512 for r in config.compress_ratios if r)
        assert split.terms["compressed_entries"] > gathered
        assert split.terms["compressed_entries"] > one.terms["compressed_entries"] / cp * 1.01
        assert split.terms["weight_casts"] == one.terms["weight_casts"] > 0
        # Everything else divides, up to the compressors' halos and the gather's index.
        whole = gathered + sum(4 * (MILLION // r) * 128 for r in config.compress_ratios if r == 4)
        whole += split.terms["weight_casts"]
        assert split.saved_bytes < (one.saved_bytes - whole) / cp * 1.01 + whole
    assert cpm.predict(config, MILLION, 1, activation_bytes=4).terms["weight_casts"] == 0


def test_flash_at_one_million_tokens_on_128_ranks_is_the_closed_form() -> None:
    p = cpm.predict(REFERENCE, MILLION, 128, rank=0)  # bf16 activations, batch 1
    assert p.tokens == 8192
    assert all(math.isfinite(v) and v >= 0 for v in p.terms.values())
    heads, length = FLASH.n_heads, 8192
    ratios = [r for r in FLASH.compress_ratios if r]
    assert ratios.count(4) == 21 and ratios.count(128) == 20
    # [L, H, N] over ALL N = S / ratio entries: fp32 softmax + its bf16 cast + the ~reads mask.
    entries = sum(
        (4 + 2) * length * heads * (MILLION // r) + length * (MILLION // r) for r in ratios
    )
    assert p.terms["entry_probs"] == entries
    # Chunked: no probabilities are kept; CSA keeps the top-k picks (int64, 512 per query).
    chunked = cpm.predict(FLASH, MILLION, 128, rank=0)
    assert chunked.terms["entry_probs"] == chunked.terms["window_probs"] == 0
    picks = 21 * 8 * length * 512
    scores = 21 * (4 * length * 64 * (MILLION // 4) + (1 + 1 + 2 * 4) * length * (MILLION // 4))
    assert p.terms["indexer"] - chunked.terms["indexer"] == scores + 21 * length - picks
    # Each rank's padded share of entries (512 wide) and indexer keys (128 wide, CSA only),
    # sent to the 127 others (ring all-gather), bf16; the backward reduce-scatters as much.
    own = {4: length // 4, 128: length // 128}
    gathered = sum(127 * 2 * own[r] * (512 + (128 if r == 4 else 0)) for r in ratios)
    comm = p.communication
    assert comm.entries_all_gather == comm.entries_reduce_scatter == gathered
    # Window halo, per layer and MTP: 127 kv rows of 512 to the next rank, and (all but rank 0)
    # their gradient back to the previous one.
    halo = (FLASH.n_layers + 1) * 2 * 127 * 512
    assert comm.window_halo == halo
    assert cpm.predict(FLASH, MILLION, 128, rank=5).communication.window_halo == 2 * halo
    assert cpm.predict(FLASH, MILLION, 1).communication.total == 0
    assert comm.recompute == 0 and chunked.communication.total == comm.total


@pytest.mark.parametrize("config", [FLASH, REFERENCE], ids=["chunked", "reference"])
def test_full_activation_checkpointing_keeps_the_block_inputs_only(
    config: DeepSeekV4Config,
) -> None:
    p = cpm.predict(config, MILLION, 128, rank=0, ac="full")  # bf16: 8192 tokens
    t, dim, vocab = 8192, 4096, FLASH.vocab_size
    streams = 2 * t * 4 * dim  # bf16 [t, n = 4, dim]
    head = (4 * t + 3 * 4 * t * 4 + 4) + 4 * t + 2 * t * dim + 4 * t * vocab
    head += 8 * MILLION  # hc_head (its fp32 scale copy), the fused norm's rsqrt, head input, labels
    mtp = 8 * t + 2 * t * dim + 2 * t * dim + 4 * t * vocab + 8 * MILLION  # ids, embedding
    # (predict's input), hidden state, log-probabilities, shifted labels
    expected = {
        "embedding": 8 * MILLION + 2 * t * dim,  # token ids, the first block's input
        "mhc_streams": FLASH.n_layers * streams,  # layers 1..42's inputs, the last output
        "head": head,
        "mtp": mtp,
    }
    assert p.terms == {term: expected.get(term, 0) for term in cpm.TERMS}
    assert p.saved_bytes / 2**30 < 20
    # The recompute holds one block's saved bytes at a time: the largest block.
    blocks = cpm.predict(config, MILLION, 128, rank=0)
    assert 0 < p.recompute_bytes < blocks.saved_bytes / 10
    # Rank 0 sends its halos forward only: the recompute sends all of it again, with the
    # all-gathers and the statistics' all-reduces; the backward's reduce-scatters once.
    comm, plain = p.communication, blocks.communication
    forward = plain.total - plain.entries_reduce_scatter
    assert comm.recompute == pytest.approx(forward, rel=1e-12)
    assert comm.total == pytest.approx(plain.total + forward, rel=1e-12)


def test_selective_checkpointing_wraps_every_nth_block() -> None:
    assert cpm.checkpointed_blocks(8, "selective", 2) == {1, 3, 5, 7}
    assert cpm.checkpointed_blocks(8, "selective", 3) == {2, 5}
    assert cpm.checkpointed_blocks(8, "full") == set(range(8))
    assert cpm.checkpointed_blocks(8, "none") == set()
    none, full, every_2 = (cpm.predict(FLASH, MILLION, 128, ac=ac) for ac in cpm.AC_MODES)
    assert full.saved_bytes < every_2.saved_bytes < none.saved_bytes
    assert every_2.recompute_bytes <= full.recompute_bytes


def test_the_default_rank_is_the_busiest() -> None:
    """Rank 0 holds the longest slice, the others also the compressors' halos: with chunked
    attention (nothing per token x entries) a later rank can keep the most."""
    debug = DeepSeekV4Config.from_flavor("debug")
    for config in (debug, debug.replace(attention_backend="reference")):
        for ac in cpm.AC_MODES:
            ranks = [cpm.predict(config, 1001, 4, rank=r, ac=ac) for r in range(4)]
            busiest = cpm.predict(config, 1001, 4, ac=ac)
            assert busiest.saved_bytes == max(r.saved_bytes for r in ranks)
            assert busiest == ranks[busiest.rank]
    ranks = [cpm.predict(debug, 1001, 4, rank=r).saved_bytes for r in range(4)]
    assert ranks[3] > ranks[0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: cpm.predict(FLASH, 100, 128), "100 tokens cannot be split over 128"),
        (lambda: cpm.predict(FLASH, 4096, 8, activation_bytes=3), "activation_bytes must be"),
        (lambda: cpm.predict(FLASH, 4096, 8, rank=8), r"rank must be in \[0, 8\)"),
        (lambda: cpm.predict(FLASH, 4096, 8, batch=0), "batch must be >= 1"),
        (
            lambda: cpm.predict(FLASH.replace(indexer_stage="dense"), 4096, 8),
            "sparse indexer stage",
        ),
        (
            lambda: cpm.predict(FLASH.replace(attention_backend="flex"), 4096, 8),
            "attention backends",
        ),
        (lambda: cpm.predict(FLASH, 4096, 8, ac="op"), "per-op selective AC is not modelled"),
        (lambda: cpm.predict(FLASH, 4096, 8, ac="some"), "ac must be one of"),
        (lambda: cpm.predict(FLASH, 4096, 8, ac="selective", ac_every=0), "ac_every must be"),
    ],
)
def test_bad_input_is_refused_by_name(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("attention", cpm.ATTENTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("seq_len", "batch", "ac"),
    [(53, 1, "none"), (53, 1, "full"), (53, 1, "selective"), (37, 2, "none"), (37, 2, "full")],
)
def test_prediction_is_what_autograd_keeps_on_one_process(
    dtype: torch.dtype, seq_len: int, batch: int, attention: str, ac: str
) -> None:
    """The micro model (every attention type, hash and learned MoE, MTP) in one process, the
    chunked backend in chunks of a few queries; selective AC wraps layers 1, 3 and the MTP."""
    config = DeepSeekV4Config.from_flavor("micro").replace(
        attention_backend=attention, attention_chunk_logits=200
    )
    torch.manual_seed(0)
    model = DeepSeekV4(config)
    cpm.cast_weights(model, dtype)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
    with cpm.activation_checkpointing(model, ac):
        loss, saved = cpm.saved_for_backward(model, tokens, torch.roll(tokens, -1, 1))
        loss.backward()  # the recompute runs
    assert torch.isfinite(loss)
    predicted = cpm.predict(config, seq_len, 1, batch, dtype.itemsize, ac=ac).saved_bytes
    assert abs(saved / predicted - 1) < TOLERANCE, (saved, predicted)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.e2e
def test_activation_memory_per_rank_falls_with_cp_and_ac_as_predicted() -> None:
    """Debug model, 501 tokens (a multiple of no block size, window or degree), CP 1 and 2 on
    gloo processes, every attention backend x AC mode, fp32 and bf16 weights (no profiler)."""
    result = cpm.check(cpm.CHECK_SEQ_LEN, (1, 2), peak=False)
    assert abs(result["worst_ratio"] - 1) < TOLERANCE
    for attention in cpm.ATTENTIONS:
        for dtype in ("fp32", "bf16"):
            runs = {
                ac: result[f"{attention}/{ac}" + ("2" if ac == "selective" else "")][dtype]
                for ac in cpm.AC_MODES
            }
            for ac, rows in runs.items():
                for cp in (1, 2):
                    row = rows[f"cp{cp}"]
                    assert len(row["rank_ratios"]) == cp
                    assert all(abs(r - 1) < TOLERANCE for r in row["rank_ratios"]), (ac, row)
                    # Every halo, all-gather, reduce-scatter and all-reduce each rank issued,
                    # the recomputed blocks' again, in bytes.
                    assert row["comm_measured_bytes"] == row["comm_predicted_bytes"], (ac, row)
                    assert (max(row["comm_measured_bytes"]) > 0) == (cp > 1)
                # CP 2 keeps about half of CP 1's bytes (the gathered entries do not divide).
                assert 0.5 < rows["cp2"]["measured_vs_first"] < 0.53, (attention, dtype, ac)
            measured = [runs[ac]["cp2"]["measured_mib"] for ac in ("none", "selective", "full")]
            assert measured[0] > measured[1] > measured[2], (attention, dtype, measured)
    for dtype in ("fp32", "bf16"):  # the chunked backend keeps less than the reference
        chunked, reference = (result[f"{a}/none"][dtype]["cp2"] for a in cpm.ATTENTIONS[::-1])
        assert chunked["measured_mib"] < reference["measured_mib"]
