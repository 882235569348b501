"""The torchtitan ModelSpec is optional: the package imports without it, the spec builds the
plain model when torchtitan is there, and its parallelize step refuses (naming them) the
parallelisms it does not do. integration/tests run it sharded on 2 ranks inside torchtitan."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch


def test_importing_the_package_does_not_import_torchtitan() -> None:
    probe = "import sys, ttnpu.dsv4; print('torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_model_spec_wraps_the_plain_model_of_its_flavor() -> None:
    pytest.importorskip("torchtitan")
    from ttnpu.dsv4 import DeepSeekV4Config
    from ttnpu.dsv4.titan import DeepSeekV4LM, model_spec

    spec = model_spec("debug", vocab_size=512)
    lm = spec.model.build()
    assert isinstance(lm, DeepSeekV4LM)
    assert lm.model.config == DeepSeekV4Config.from_flavor("debug").replace(vocab_size=512)
    tokens = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    assert lm(tokens).shape == (1, 8, 512)


def _dims(**degrees: int) -> Any:
    from torchtitan.distributed import ParallelDims

    sizes = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    world = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
    return ParallelDims(**sizes, world_size=world)


@pytest.mark.parametrize(
    ("degrees", "named"),
    [
        ({"tp": 2}, "{'tp': 2}"),
        ({"tp": 2, "cp": 2}, "{'tp': 2}"),
        ({"pp": 4}, "{'pp': 4}"),
        ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, "{'dp_replicate': 2}"),
    ],
)
def test_parallelize_names_the_parallelism_it_does_not_support(
    degrees: dict[str, int], named: str
) -> None:
    pytest.importorskip("torchtitan")
    from ttnpu.dsv4.titan import model_spec

    spec = model_spec("debug")
    with torch.device("meta"):
        model = spec.model.build()
    with pytest.raises(ValueError, match=f"unsupported parallelism degrees {named}"):
        spec.parallelize_fn(model, parallel_dims=_dims(**degrees))


def test_parallelize_wants_ep_to_take_the_whole_fsdp_group() -> None:
    pytest.importorskip("torchtitan")
    from ttnpu.dsv4.titan import model_spec

    spec = model_spec("debug")
    with torch.device("meta"):
        model = spec.model.build()
    with pytest.raises(
        ValueError, match=r"\{'dp_shard': 4, 'cp': 1, 'ep': 2\}: ep must be 1 or dp_shard x cp"
    ):
        spec.parallelize_fn(model, parallel_dims=_dims(dp_shard=4, ep=2))
    with pytest.raises(ValueError, match=r"\{'dp_shard': 2, 'cp': 2, 'ep': 2\}"):
        spec.parallelize_fn(model, parallel_dims=_dims(dp_shard=2, cp=2, ep=2))


def test_parallelize_leaves_a_one_rank_model_alone_and_rejects_other_models() -> None:
    pytest.importorskip("torchtitan")
    from ttnpu.dsv4.titan import model_spec

    spec = model_spec("debug")
    with torch.device("meta"):
        model = spec.model.build()
    assert spec.parallelize_fn(model, parallel_dims=_dims()) is model
    with pytest.raises(ValueError, match="shards a DeepSeekV4LM, got Linear"):
        spec.parallelize_fn(torch.nn.Linear(2, 2), parallel_dims=_dims(dp_shard=2))


def test_a_sequence_too_short_for_the_cp_halos_is_refused_when_the_config_is_read() -> None:
    pytest.importorskip("torchtitan")
    from types import SimpleNamespace

    from ttnpu.dsv4.titan import model_spec

    def job(seq_len: int, cp: int) -> Any:
        return SimpleNamespace(
            training=SimpleNamespace(seq_len=seq_len),
            parallelism=SimpleNamespace(context_parallel_degree=cp),
        )

    config = model_spec("debug").model  # window 32: each CP rank sends 31 tokens
    config.update_from_config(config=job(64, 2))
    with pytest.raises(ValueError, match="rank 0 holds 20 tokens, fewer than the 31-token halo"):
        config.update_from_config(config=job(40, 2))
