"""RouteCache: narrow dtypes, on device, and every missing or corrupted entry is an error."""

from __future__ import annotations

import pytest
import torch

from ttnpu.routing import RouteCache, RouteCacheError, RouterSpec, index_dtype

SPECS = {"layers.0.router": RouterSpec(8, 2), "layers.1.router": RouterSpec(300, 3)}


def routes(tokens: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.stack(
            [torch.randperm(s.num_experts, generator=g)[: s.top_k] for _ in range(tokens)]
        )
        for name, s in SPECS.items()
    }


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [
        (1, torch.uint8),
        (256, torch.uint8),
        (257, torch.int16),
        (32768, torch.int16),
        (32769, torch.int32),
        (2**31, torch.int32),
        (2**31 + 1, torch.int64),
    ],
)
def test_narrowest_dtype(experts: int, dtype: torch.dtype) -> None:
    assert index_dtype(experts) == dtype


def test_round_trip_in_narrow_dtypes() -> None:
    cache = RouteCache(SPECS)
    stored = [routes(seed=0), routes(seed=1)]
    cache.put(7, stored)
    assert cache.steps == [7] and cache.microbatches(7) == 2
    assert cache.nbytes == 2 * (5 * 2 * 1 + 5 * 3 * 2)  # two micro-batches of uint8 + int16
    for mb in range(2):
        got = cache.get(7, mb)
        for name in SPECS:
            assert got[name].dtype == torch.int64
            assert torch.equal(got[name], stored[mb][name])
    cache.drop(7)
    assert 7 not in cache


def test_missing_entries() -> None:
    cache = RouteCache(SPECS)
    cache.put(3, [routes()])
    with pytest.raises(RouteCacheError, match=r"no routes for step 4 \(cached steps: 3\)"):
        cache.get(4, 0)
    with pytest.raises(RouteCacheError, match=r"micro-batches 0..0, not 1"):
        cache.get(3, 1)
    partial = routes()
    del partial["layers.1.router"]
    with pytest.raises(RouteCacheError, match=r"missing routers \['layers.1.router'\]"):
        cache.put(4, [partial])


@pytest.mark.parametrize("position", [0, 7, 14])
def test_a_flipped_bit_is_caught(position: int) -> None:
    cache = RouteCache(SPECS)
    cache.put(1, [routes()])
    entry = cache._steps[1][0]["layers.1.router"].indices.view(-1)
    entry[position] ^= 1  # stays in range: only the checksum can see it
    with pytest.raises(
        RouteCacheError,
        match=r"step 1 micro-batch 0 is corrupted: router 'layers.1.router': checksum mismatch",
    ):
        cache.get(1, 0)


def test_out_of_range_and_malformed_entries() -> None:
    cache = RouteCache(SPECS)
    cache.put(1, [routes()])
    entry = cache._steps[1][0]["layers.0.router"]
    entry.indices[0, 0] = 200
    with pytest.raises(
        RouteCacheError, match=r"'layers.0.router': (checksum mismatch|index out of range)"
    ):
        cache.get(1, 0)
    entry.indices = entry.indices[:, :1]
    with pytest.raises(
        RouteCacheError, match=r"expected \[num_tokens, 2\] torch.uint8, got \[5, 1\]"
    ):
        cache.get(1, 0)
    with pytest.raises(RouteCacheError, match=r"expected \[num_tokens, 2\] indices"):
        cache.put(
            2,
            [
                {
                    "layers.0.router": torch.zeros(5, 3, dtype=torch.int64),
                    "layers.1.router": torch.zeros(5, 3, dtype=torch.int64),
                }
            ],
        )
    with pytest.raises(RouteCacheError, match="expected integer indices"):
        cache.put(2, [{n: torch.zeros(5, s.top_k) for n, s in SPECS.items()}])
    with pytest.raises(RouteCacheError, match="already cached"):
        cache.put(1, [routes()])


def test_state_dict_keeps_checksums_and_a_bad_state_changes_nothing() -> None:
    cache = RouteCache(SPECS)
    cache.put(1, [routes(seed=3)])
    state = cache.state_dict()
    state["steps"]["1"][0]["layers.0.router"]["indices"][2, 1] ^= 4
    other = RouteCache(SPECS)
    other.load_state_dict(state)
    with pytest.raises(RouteCacheError, match="checksum mismatch"):
        other.get(1, 0)
    del state["steps"]["1"][0]["layers.0.router"]["checksum"]
    with pytest.raises(RouteCacheError, match="malformed state"):
        cache.load_state_dict(state)
    assert torch.equal(cache.get(1, 0)["layers.0.router"], routes(seed=3)["layers.0.router"])
