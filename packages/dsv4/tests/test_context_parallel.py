"""Context parallelism on 2 and 4 gloo processes: summed over the CP ranks, every loss term and
every gradient of the chunked attention backend equals the one-process reference backend's, for
sequence lengths that are multiples of neither
the degree nor the block sizes, and for every attention type (sliding window, CSA with its
indexer in both stages, HCA, MTP, and YaRN); FSDP over data x context ranks, with the experts
split over those ranks too, gives the one-process gradients of the whole batch. A slice shorter
than the halo it must send is refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.context_parallel import compressor_halo, split
from ttnpu.dsv4.parallel import check_context_parallel

SEQ_LENS = (37, 53)  # multiples of neither 2, 4 (CP), 4 (CSA) nor 8 (HCA)
TOLERANCE = 2e-5
CASES = ("window", "csa", "csa-dense", "hca", "mixed", "mixed-yarn")


def _config(case: str) -> DeepSeekV4Config:
    base = DeepSeekV4Config.from_flavor("micro").replace(n_mtp_layers=1, index_topk=3)
    ratios = {
        "window": (0, 0, 0, 0),
        "csa": (0, 4, 0, 4),
        "csa-dense": (0, 4, 0, 4),
        "hca": (0, 8, 0, 8),
        "mixed": (0, 4, 8, 4),
        "mixed-yarn": (0, 4, 8, 4),
    }[case]
    stage = "dense" if case == "csa-dense" else "sparse"
    config = base.replace(compress_ratios=ratios, indexer_stage=stage)
    if case == "mixed-yarn":  # YaRN on the compressed layers' RoPE, as Flash has it
        config = config.replace(use_yarn=True, rope_factor=4.0, original_seq_len=16)
    return config


def _batch(seq_len: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (batch, seq_len), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, 1)
    labels[:, 5] = -100  # ignored labels inside a slice (as many in every row: see _fsdp_worker)
    return tokens, labels


def _terms_and_grads(model: DeepSeekV4, tokens: torch.Tensor, labels: torch.Tensor):
    model.zero_grad()
    terms = model.losses(tokens, labels)
    terms.total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack([t.detach() for t in terms]), grads


def _cp_worker(rank: int, world: int, port: int, out: Path) -> None:
    """Every case on this rank: the largest difference between the CP shares summed over the
    group and the one-process results, and the refusal of too-short slices."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ttnpu.dsv4.parallel import apply_context_parallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))

    def summed(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    report: dict[str, float | str] = {}
    for case in CASES:
        # The chunked backend in small chunks against the reference backend in one process.
        config = _config(case).replace(attention_chunk_logits=96, index_select_logits=96)
        torch.manual_seed(0)
        reference = DeepSeekV4(config.replace(attention_backend="reference"))
        torch.manual_seed(0)
        model = DeepSeekV4(config)
        apply_context_parallel(model, mesh)
        for seq_len in SEQ_LENS:
            tokens, labels = _batch(seq_len)
            want_terms, want_grads = _terms_and_grads(reference, tokens, labels)
            terms, grads = _terms_and_grads(model, tokens, labels)
            assert grads.keys() == want_grads.keys()
            diff = (summed(terms) - want_terms).abs().max()
            for name, grad in grads.items():
                scale = want_grads[name].abs().max().clamp_min(1e-3)
                diff = torch.maximum(diff, (summed(grad) - want_grads[name]).abs().max() / scale)
            report[f"{case}/{seq_len}"] = float(diff)
            report[f"{case}/{seq_len}/loss"] = float(want_terms[0])
    try:
        model.loss(*_batch(3 * world))  # 3-token slices, a 7-token window halo
    except ValueError as error:
        report["short"] = str(error)
    out.write_text(json.dumps(report))
    dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, port: int, out: Path) -> None:
    """FSDP and expert parallelism over 2 data x 2 context ranks: the sharded gradients of each
    rank's share, reduced by FSDP and the all-to-all, against the one-process gradients of the
    whole batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ttnpu.dsv4.parallel import apply_context_parallel, apply_expert_parallel, apply_fsdp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    reference = DeepSeekV4(_config("mixed"))
    torch.manual_seed(0)
    model = DeepSeekV4(_config("mixed"))
    apply_context_parallel(model, grid["cp"])
    data_and_context = grid._flatten("dp_cp")
    apply_expert_parallel(model, data_and_context)  # 4 of the 16 experts per rank
    apply_fsdp(model, data_and_context)
    tokens, labels = _batch(SEQ_LENS[0], batch=4)  # each data rank's mean: over equal counts
    _, want = _terms_and_grads(reference, tokens, labels)
    rows = slice(2 * grid.get_local_rank("dp"), 2 * grid.get_local_rank("dp") + 2)
    model.loss(tokens[rows], labels[rows]).backward()
    diff = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor()
        scale = want[name].abs().max().clamp_min(1e-3)
        diff = max(diff, float((grad - want[name]).abs().max() / scale))
    out.write_text(json.dumps({"fsdp": diff}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(worker: str, world: int, tmp_path: Path) -> list[dict]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                worker,
                str(r),
                str(world),
                str(port),
                str(tmp_path / f"{r}"),
            ],
            env=env,
        )
        for r in range(world)
    ]
    assert [p.wait(timeout=600) for p in procs] == [0] * world
    return [json.loads((tmp_path / f"{r}").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_shares_sum_to_the_one_process_losses_and_gradients(world: int, tmp_path: Path) -> None:
    reports = _run("cp", world, tmp_path)
    for report in reports:
        cases = {k: v for k, v in report.items() if k.count("/") == 1}
        assert len(cases) == len(CASES) * len(SEQ_LENS)
        assert all(v < TOLERANCE for v in cases.values()), cases
        assert all(report[f"{k}/loss"] > 1 for k in cases)  # real losses, not zeros
        assert "fewer than the 7-token halo of the 8-token sliding window" in report["short"]


def test_fsdp_and_ep_over_data_and_context_ranks_match_one_process(tmp_path: Path) -> None:
    for report in _run("fsdp", 4, tmp_path):
        assert report["fsdp"] < TOLERANCE


def test_too_short_slices_are_refused_before_training() -> None:
    config = _config("mixed")  # window 8, CSA 4 (reads 2 blocks), HCA 8
    check_context_parallel(config, 37, 4)  # slices 10, 9, 9, 9: every halo fits
    with pytest.raises(ValueError, match="rank 0 holds 6 tokens, fewer than the 7-token halo"):
        check_context_parallel(config, 24, 4)
    with pytest.raises(ValueError, match="cannot be split over 4"):
        check_context_parallel(config, 3, 4)
    assert split(37, 4) == ((0, 10), (10, 19), (19, 28), (28, 37))
    # A slice starting at 19 reads block 4 (16..19) and, with CSA's overlap, block 3 (12..15).
    assert compressor_halo(19, 4, True) == 7 and compressor_halo(19, 8, False) == 3


def test_halo_and_gather_without_a_group_cost_nothing() -> None:
    from ttnpu.dsv4.context_parallel import SequenceShard

    shard = SequenceShard.whole(10)
    x = torch.randn(2, 10, 3)
    assert torch.equal(shard.halo(x, 4, "window"), torch.zeros(2, 4, 3))
    assert shard.gather_entries(x, 4) is x
    assert torch.equal(shard.local(x), x)


if __name__ == "__main__":
    workers = {"cp": _cp_worker, "fsdp": _fsdp_worker}
    workers[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
