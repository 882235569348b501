"""tools/cp_memory_model.py: the context-parallel memory/communication model of ttnpu-dsv4.

Unit checks of ``predict`` (what must scale as 1/cp does, what must not does not, the Flash
figures at 1M tokens / CP 128 are the closed forms) and of the prediction against the bytes
autograd really keeps on the one-process micro model; the e2e check runs the debug model on real
gloo processes for CP 1, 2 and 4 (fp32 and bf16 weights) and requires the measured activation
memory per rank, and its peak of live bytes, to fall strictly, every rank's bytes to be the
predicted ones, and every rank's CP traffic to be the predicted traffic.
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
FLASH = DeepSeekV4Config.from_flavor("flash")
MILLION = 1 << 20

# Terms proportional to this rank's tokens (no halo, no gathered whole-sequence part), up to
# per-layer constants of a few hundred bytes (the experts' group offsets).
PER_TOKEN = (
    "mhc_streams",
    "mhc_mixing",
    "window_probs",
    "entry_probs",
    "attention_output",
    "moe_routed",
    "moe_shared",
)


def test_per_token_terms_scale_as_one_over_cp_and_the_rest_does_not() -> None:
    one = cpm.predict(FLASH, MILLION, 1)
    for cp in (8, 128):
        split = cpm.predict(FLASH, MILLION, cp)
        for term in PER_TOKEN:
            assert split.terms[term] * cp == pytest.approx(one.terms[term], rel=1e-6), term
        # Every rank keeps all S / ratio entries (bf16, 512 wide): that part does not divide.
        gathered = sum(2 * (MILLION // r) * 512 for r in FLASH.compress_ratios if r)
        assert split.terms["compressed_entries"] > gathered
        assert split.terms["compressed_entries"] > one.terms["compressed_entries"] / cp * 1.01
        assert split.terms["weight_casts"] == one.terms["weight_casts"] > 0
        assert split.saved_bytes < one.saved_bytes / cp * 1.05
    assert cpm.predict(FLASH, MILLION, 1, activation_bytes=4).terms["weight_casts"] == 0


def test_flash_at_one_million_tokens_on_128_ranks_is_the_closed_form() -> None:
    p = cpm.predict(FLASH, MILLION, 128)  # bf16 activations, batch 1, rank 0
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


def test_the_busiest_rank_holds_the_longest_slice() -> None:
    debug = DeepSeekV4Config.from_flavor("debug")
    ranks = [cpm.predict(debug, 1001, 4, rank=r).saved_bytes for r in range(4)]
    assert cpm.predict(debug, 1001, 4).saved_bytes == ranks[0] == max(ranks)


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
    ],
)
def test_bad_input_is_refused_by_name(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seq_len", "batch"), [(53, 1), (37, 2)])
def test_prediction_is_what_autograd_keeps_on_one_process(
    dtype: torch.dtype, seq_len: int, batch: int
) -> None:
    """The micro model (every attention type, hash and learned MoE, MTP) in one process."""
    config = DeepSeekV4Config.from_flavor("micro")
    torch.manual_seed(0)
    model = DeepSeekV4(config)
    cpm.cast_weights(model, dtype)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
    loss, saved = cpm.saved_for_backward(model, tokens, torch.roll(tokens, -1, 1))
    assert torch.isfinite(loss)
    predicted = cpm.predict(config, seq_len, 1, batch, dtype.itemsize).saved_bytes
    assert abs(saved / predicted - 1) < TOLERANCE, (saved, predicted)


@pytest.mark.e2e
def test_activation_memory_per_rank_falls_with_cp_as_predicted() -> None:
    """Debug model, 1001 tokens (a multiple of no block size, window or degree), CP 1/2/4 on
    gloo processes, fp32 and bf16 weights."""
    result = cpm.check(cpm.CHECK_SEQ_LEN, (1, 2, 4))
    for dtype in ("fp32", "bf16"):
        rows = [result[dtype][f"cp{cp}"] for cp in (1, 2, 4)]
        measured = [row["measured_mib"] for row in rows]
        assert measured[0] > measured[1] > measured[2], (dtype, measured)
        peaks = [row["peak_live_mib"] for row in rows]
        assert peaks[0] > peaks[1] > peaks[2], (dtype, peaks)
        for cp, row in zip((1, 2, 4), rows, strict=True):
            assert len(row["rank_ratios"]) == cp
            assert all(abs(r - 1) < TOLERANCE for r in row["rank_ratios"]), (dtype, cp, row)
            # Every halo, all-gather, reduce-scatter and all-reduce each rank issued, in bytes.
            assert row["comm_measured_bytes"] == row["comm_predicted_bytes"], (dtype, cp, row)
            assert (max(row["comm_measured_bytes"]) > 0) == (cp > 1)
        # CP 4 keeps about a quarter of CP 1's bytes (the gathered entries do not divide).
        assert 0.25 < rows[2]["measured_vs_first"] < 0.27
