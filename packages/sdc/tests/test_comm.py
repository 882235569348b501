from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from ttnpu.sdc import (
    CollectiveChecker,
    ReductionChecksums,
    Reporter,
    VetoFlag,
    chunk_length,
    comm,
    flip_bit,
)

from .threaded import run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_chunk_length_keeps_the_bound_under_half_the_chunk_maximum() -> None:
    assert chunk_length(torch.bfloat16, 2) == 127
    assert chunk_length(torch.float32, 2) == 2047
    assert chunk_length(torch.bfloat16, 8) < chunk_length(torch.bfloat16, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_collectives_verify(dtype: torch.dtype) -> None:
    def body(group: dist.ProcessGroup, rank: int) -> tuple[bool, bool, bool, int]:
        flag = VetoFlag()
        checker = CollectiveChecker(group, reporter=Reporter([flag], rank=rank))
        g = torch.Generator().manual_seed(rank)
        x = (torch.randn(5000, generator=g) * 10 ** (rank * 2 - 1)).to(dtype)
        ok1 = checker.all_reduce(x)
        out = torch.empty(2500, dtype=dtype)
        ok2 = checker.reduce_scatter_tensor(out, torch.randn(5000, generator=g).to(dtype))
        gathered = torch.empty(6000, dtype=dtype)
        ok3 = checker.all_gather_into_tensor(gathered, torch.randn(3000, generator=g).to(dtype))
        return ok1, ok2, ok3, len(flag.take())

    for result in run_ranks(2, body):
        assert result == (True, True, True, 0)


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"])
def test_corruption_on_one_rank_is_reported_by_that_rank_at_that_call(name: str) -> None:
    def corrupt(rank: int):
        def fault(op: str, result: torch.Tensor) -> None:
            if rank == 1 and op == name and checker_calls[rank] == 3:
                flip_bit(result, 123, 30)

        return fault

    checker_calls = [0, 0]

    def body(group: dist.ProcessGroup, rank: int) -> list[tuple[str, int, bool]]:
        flag = VetoFlag()
        checker = CollectiveChecker(
            group, reporter=Reporter([flag], rank=rank), fault=corrupt(rank)
        )
        for call in range(1, 5):
            checker_calls[rank] = call
            x = torch.randn(4096)
            if name == "all_reduce":
                checker.all_reduce(x)
            elif name == "reduce_scatter_tensor":
                checker.reduce_scatter_tensor(torch.empty(2048), x)
            else:
                checker.all_gather_into_tensor(torch.empty(8192), x)
        return [(e.where, e.rank, e.confirmed) for e in flag.take()]

    reports = run_ranks(2, body)
    assert reports[0] == []
    assert len(reports[1]) == 1
    where, rank, confirmed = reports[1][0]
    assert where.startswith(name) and "#3" in where and rank == 1 and confirmed


def test_random_flips_at_least_the_chunk_maximum_are_all_caught() -> None:
    def body(group: dist.ProcessGroup, rank: int) -> tuple[int, int]:
        flips = {"must": 0, "caught": 0}
        magnitude = torch.empty(0)  # per element: sum over ranks of |input|
        g = torch.Generator().manual_seed(100)  # same flip plan on both ranks

        def fault(op: str, result: torch.Tensor) -> None:
            if rank == 0:
                index = int(torch.randint(result.numel(), (1,), generator=g))
                bit = int(torch.randint(16, (1,), generator=g))
                length = chunk_length(result.dtype, 2)
                start = index // length * length
                chunk_max = float(magnitude[start : start + length].max())
                delta = flip_bit(result, index, bit)
                fault.must = abs(delta) >= chunk_max or math.isnan(delta)  # type: ignore[attr-defined]

        checker = CollectiveChecker(group, reporter=Reporter([], rank=rank), fault=fault)
        for trial in range(60):
            x = (torch.randn(1000) * 10 ** (trial % 7 - 3)).to(torch.bfloat16)
            magnitude = x.abs().float()
            dist.all_reduce(magnitude, group=group)
            ok = checker.all_reduce(x)
            if rank == 0 and fault.must:  # type: ignore[attr-defined]
                flips["must"] += 1
                flips["caught"] += not ok
        return flips["must"], flips["caught"]

    must, caught = run_ranks(2, body)[0]
    assert must >= 5 and caught == must


def test_only_sum_is_verified() -> None:
    def body(group: dist.ProcessGroup, rank: int) -> None:
        with pytest.raises(ValueError, match=r"verifies SUM reductions here, got .*MAX"):
            CollectiveChecker(group).all_reduce(torch.ones(3), op=dist.ReduceOp.MAX)
        with pytest.raises(ValueError, match=r"verifies SUM and AVG reductions here"):
            CollectiveChecker(group).reduce_scatter_tensor(
                torch.empty(3), torch.ones(3), op=dist.ReduceOp.MAX
            )

    run_ranks(1, body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_averaging_reduce_scatter_is_verified(dtype: torch.dtype) -> None:
    """AVG (FSDP2's op for fp32 and bf16 gradients): the clean average verifies and equals the
    plain one; a flipped exponent bit in rank 1's shard is a confirmed event there only."""

    def body(group: dist.ProcessGroup, rank: int) -> tuple[bool, bool, int, bool]:
        flag = VetoFlag()

        def fault(op: str, result: torch.Tensor) -> None:
            if rank == 1 and checker.calls == 2:
                flip_bit(result, 77, 14 if dtype == torch.bfloat16 else 30)

        checker = CollectiveChecker(group, reporter=Reporter([flag], rank=rank), fault=fault)
        g = torch.Generator().manual_seed(rank)
        x = (torch.randn(6000, generator=g) * 10 ** (rank - 1)).to(dtype)
        out, plain = torch.empty(3000, dtype=dtype), torch.empty(3000, dtype=dtype)
        clean = checker.reduce_scatter_tensor(out, x, op=dist.ReduceOp.AVG)
        dist.reduce_scatter_single(plain, x, op=dist.ReduceOp.AVG, group=group)
        flipped = checker.reduce_scatter_tensor(torch.empty_like(out), x, op=dist.ReduceOp.AVG)
        events = flag.take()
        return clean, flipped, len(events), torch.equal(out, plain)

    assert run_ranks(2, body) == [(True, True, 0, True), (True, False, 1, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("average", [False, True])
def test_a_reduction_run_elsewhere_is_verified_from_its_checksums(
    dtype: torch.dtype, average: bool
) -> None:
    """Two replicas' buffers reduced as torchft's Manager would (SUM or AVG), checksums reduced
    alongside: the clean result verifies; a flipped exponent bit in it is a confirmed event."""
    gen = torch.Generator().manual_seed(0)
    local = [torch.randn(10_000, generator=gen).to(dtype) for _ in range(2)]
    flag = VetoFlag()
    checks = [ReductionChecksums(max_world=4, reporter=Reporter([flag], rank=r)) for r in (0, 1)]
    sums = [c.before(x) for c, x in zip(checks, local, strict=True)]
    divide = 2 if average else 1
    result = ((local[0].float() + local[1].float()) / divide).to(dtype)
    reduced = (sums[0] + sums[1]) / divide
    assert checks[0].after(result.clone(), reduced, world=2)
    corrupted = result.clone()
    flip_bit(corrupted, 1234, 30 if dtype == torch.float32 else 14)
    assert not checks[1].after(corrupted, reduced, world=2)
    [event] = flag.take()
    assert (event.kind, event.confirmed, event.rank, event.where) == (
        "collective", True, 1, "all_reduce#1",
    )  # fmt: skip
    assert event.detail["first_bad_element"] <= 1234
    with pytest.raises(ValueError, match=r"world 5 must be in \[1, max_world = 4\]"):
        checks[0].after(result, reduced, world=5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_compiled_checksums_are_the_eager_ones_and_flag_the_same_flip(
    dtype: torch.dtype,
) -> None:
    """One fused pass (Inductor) and the eager ops give the same sums and the same verdict."""
    length = chunk_length(dtype, 2)
    x = (torch.randn(20 * length + 5, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    eager = comm._eager_chunk_sums(x, length)
    compiled = comm._chunk_sums.compiled(x, length, True)
    assert compiled.shape == eager.shape == (2, 21)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-5)
    coefficient = 2.0 * length * comm._U32 + 2 * comm.unit_roundoff(dtype)
    args = (eager[0], eager[1], length, coefficient)
    for suspect in (comm._suspect.eager, comm._suspect.compiled):
        assert not bool(suspect(x, *args))
        flipped = x.clone()
        flip_bit(flipped, 7 * length + 3, 14 if dtype == torch.bfloat16 else 30)
        assert bool(suspect(flipped, *args))
