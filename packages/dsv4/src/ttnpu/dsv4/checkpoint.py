"""Conversion between this package's state dict and the official DeepSeek-V4 checkpoint layout
(the key names of the published weights, which transformers' DeepseekV4 loads), and save/load of a
model directory (``config.json`` + safetensors) in that layout or in transformers' own
(:mod:`ttnpu.dsv4.hf_checkpoint`).

The module tree mirrors the official names, so only two things change: routed experts are stacked
here (``ffn.experts.w1`` [E, ...]) and per-expert there (``ffn.experts.{j}.w1.weight``), and the
selection bias is ``ffn.expert_bias`` here and ``ffn.gate.bias`` there (learned gates only).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from .config import DeepSeekV4Config
from .hf_checkpoint import (
    INDEX,
    CheckpointError,
    HFCheckpointReader,
    Scan,
    Source,
    from_hf,
    scan_checkpoint,
    to_hf,
)
from .model import DeepSeekV4

__all__ = [
    "CheckpointError",
    "from_official",
    "load_official_state_dict",
    "load_pretrained",
    "load_weights",
    "save_pretrained",
    "to_official",
]

_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")
_PER_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_BIAS = re.compile(r"^(.*\.ffn)\.expert_bias$")
_GATE_BIAS = re.compile(r"^(.*\.ffn)\.gate\.bias$")
_BLOCK = re.compile(r"^(layers|mtp)\.\d+\.")

logger = logging.getLogger(__name__)


def to_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This package's state dict -> official key names and layout."""
    out: dict[str, torch.Tensor] = {}
    hash_ffns = {k.removesuffix(".gate.tid2eid") for k in state if k.endswith(".gate.tid2eid")}
    for key, value in state.items():
        if stacked := _STACKED.match(key):
            prefix, name = stacked.groups()
            for j, expert in enumerate(value.unbind(0)):
                out[f"{prefix}.{j}.{name}.weight"] = expert.clone()
        elif bias := _BIAS.match(key):
            if bias.group(1) not in hash_ffns:  # hash layers carry no selection bias
                out[f"{bias.group(1)}.gate.bias"] = value
        else:
            out[key] = value
    return out


def from_official(
    state: Mapping[str, torch.Tensor], config: DeepSeekV4Config, *, source: str = "state dict"
) -> dict[str, torch.Tensor]:
    """Official key names -> this package's state dict, checked against ``config``'s model.

    Raises :class:`CheckpointError` naming every missing, unexpected and wrongly shaped key."""
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if per := _PER_EXPERT.match(key):
            prefix, j, name = per.groups()
            experts.setdefault((prefix, name), {})[int(j)] = value
        elif bias := _GATE_BIAS.match(key):
            out[f"{bias.group(1)}.expert_bias"] = value
        else:
            out[key] = value
    with torch.device("meta"):
        expected = DeepSeekV4(config).state_dict()
    missing: list[str] = []
    unexpected: list[str] = []
    mismatched: list[str] = []
    for (prefix, name), by_index in experts.items():
        key = f"{prefix}.{name}"
        shape = expected[key].shape if key in expected else None
        count = shape[0] if shape is not None else 0
        spelled = {j: f"{prefix}.{j}.{name}.weight" for j in by_index}
        unexpected += [spelled[j] for j in by_index if j >= count]
        missing += [f"{prefix}.{j}.{name}.weight" for j in range(count) if j not in by_index]
        wrong = [
            f"{spelled[j]} {list(by_index[j].shape)} != {list(shape[1:])}"
            for j in range(count)
            if shape is not None and j in by_index and by_index[j].shape != shape[1:]
        ]
        mismatched += wrong
        if count and not wrong and all(j in by_index for j in range(count)):
            out[key] = torch.stack([by_index[j] for j in range(count)])
        elif count:
            expected.pop(key)  # reported per expert above
    for key, value in expected.items():  # hash layers have a zero bias that is not exported
        hash_table = key.removesuffix("expert_bias") + "gate.tid2eid"
        if key.endswith(".expert_bias") and key not in out and hash_table in out:
            out[key] = torch.zeros_like(value, device="cpu")
    missing += sorted(_officialise(k) for k in expected.keys() - out.keys())
    unexpected += sorted(out.keys() - expected.keys())
    mismatched += sorted(
        f"{key} {list(out[key].shape)} != {list(value.shape)}"
        for key, value in expected.items()
        if key in out and out[key].shape != value.shape and not _STACKED.match(key)
    )
    if missing or unexpected or mismatched:
        raise CheckpointError(sorted(missing), sorted(unexpected), sorted(mismatched), source)
    return {k: out[k] for k in expected}


def _officialise(key: str) -> str:
    """Name a missing internal key the way the official checkpoint spells it."""
    if stacked := _STACKED.match(key):
        return f"{stacked.group(1)}.<j>.{stacked.group(2)}.weight"
    if bias := _BIAS.match(key):
        return f"{bias.group(1)}.gate.bias"
    return key


def load_official_state_dict(
    model: DeepSeekV4, state: Mapping[str, torch.Tensor], *, source: str = "state dict"
) -> None:
    """Load an official-layout state dict; nothing changes unless every key fits."""
    converted = from_official(state, model.config, source=source)
    current = model.state_dict()
    with torch.no_grad():
        for key, value in converted.items():
            current[key].copy_(value)


def save_pretrained(
    model: DeepSeekV4,
    directory: str | os.PathLike[str],
    *,
    layout: Literal["official", "hf"] = "official",
    shard_bytes: int = 5 << 30,
) -> Path:
    """Write ``config.json`` and the weights: ``model.safetensors`` in the official layout, or
    with ``layout="hf"`` transformers' names in ``model-0000k-of-0000n.safetensors`` shards of at
    most ``shard_bytes`` (a tensor larger than that gets a shard of its own) with their
    ``model.safetensors.index.json``, written by torch.distributed.checkpoint's Hugging Face writer.

    The files are written atomically as a set: they go into a fresh directory beside
    ``directory``, which then takes its place, so a kill leaves the old set or the new one, never
    new weights beside an old config (a kill leaves at most a hidden ``.<name>.*`` directory
    beside it). An existing ``directory`` must hold only such a set (stale ``*.safetensors``
    shards go with it; other files are refused, since they would be lost). Replacing it takes two
    renames; a kill between them leaves no ``directory`` and the old set intact in
    ``.<name>.old-*``."""
    if layout not in ("official", "hf"):
        raise ValueError(f"save_pretrained: layout must be 'official' or 'hf', got {layout!r}")
    path = Path(directory)
    if path.is_dir() and (others := sorted(_foreign_files(path))):
        raise ValueError(f"{path} holds files other than a saved model: {', '.join(others)}")
    state = model.state_dict()
    weights = to_official(state) if layout == "official" else to_hf(state)
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    config = json.dumps(model.config.to_hf_config(), indent=2, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.new-"))
    try:
        if layout == "official":
            save_file(tensors, staging / "model.safetensors")
        else:
            _write_shards(tensors, staging, shard_bytes)
        (staging / "config.json").write_text(config)
        if path.is_dir() and any(path.iterdir()):
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            os.replace(path, old)
            os.replace(staging, path)
            shutil.rmtree(old)
        else:
            os.replace(staging, path)  # replaces an empty directory too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _write_shards(tensors: dict[str, torch.Tensor], directory: Path, shard_bytes: int) -> None:
    """Shards of at most ``shard_bytes`` in key order, and their index, from this process."""
    if shard_bytes <= 0:
        raise ValueError(f"save_pretrained: shard_bytes must be positive, got {shard_bytes}")
    shard_of: dict[str, int] = {}
    shard, used = 1, 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if used and used + size > shard_bytes:
            shard, used = shard + 1, 0
        shard_of[key], used = shard, used + size
    writer = HuggingFaceStorageWriter(str(directory), fqn_to_index_mapping=shard_of)
    with _one_process():
        dcp.save(tensors, storage_writer=writer, no_dist=True)


@contextmanager
def _one_process() -> Iterator[None]:
    """torch.distributed.checkpoint in this process alone, without its warning that it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _foreign_files(path: Path) -> list[str]:
    """Entries of a model directory that ``save_pretrained`` does not write."""
    return [
        p.name
        for p in path.iterdir()
        if not (p.is_file() and (p.name in ("config.json", INDEX) or p.suffix == ".safetensors"))
    ]


def load_pretrained(directory: str | os.PathLike[str], *, source: Source = "auto") -> DeepSeekV4:
    """Build a model from ``config.json`` and stream in its weights (:func:`load_weights`):
    official or transformers names, detected from the files (or ``source``). Only the files that
    ``model.safetensors.index.json`` names (else ``model.safetensors``) are read. A folder
    without MTP weights (transformers saves none) gives a model without MTP, with a warning."""
    path = Path(directory)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found")
    config = DeepSeekV4Config.from_hf_config(json.loads(config_file.read_text()))
    scan = scan_checkpoint(path, source)
    if config.n_mtp_layers and not scan.has_mtp:
        logger.warning(
            "%s has no MTP weights (transformers' DeepseekV4 saves none): the model is built "
            "with n_mtp_layers=0 (no MTP loss)",
            path,
        )
        config = config.replace(n_mtp_layers=0)
    model = DeepSeekV4(config)
    load_weights(model, path, source=source, scan=scan)
    return model


def load_weights(
    model: DeepSeekV4,
    directory: str | os.PathLike[str],
    *,
    source: Source = "auto",
    scan: Scan | None = None,
) -> None:
    """Stream a checkpoint folder's weights into ``model`` through torch.distributed.checkpoint,
    one block at a time: tensors are read straight into the model's, except the routed experts'
    ``w1`` / ``w3``, which go through one block's ``gate_up_proj`` buffer. With FSDP/EP-sharded
    parameters (DTensors) under an initialised process group, each rank reads only its slices.
    Every key and shape is checked before anything changes (:class:`CheckpointError`). MTP
    weights the folder lacks keep their values (a warning says so). ``scan``: the folder's
    :func:`~ttnpu.dsv4.hf_checkpoint.scan_checkpoint`, if done."""
    state = model.state_dict()
    with torch.device("meta"):
        expected = {k: v.shape for k, v in to_hf(DeepSeekV4(model.config).state_dict()).items()}
    reader = HFCheckpointReader(directory, expected, source=source, scan=scan)
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        block = _BLOCK.match(key)
        blocks.setdefault(block.group(0) if block else "", {})[key] = value
    for block_state in blocks.values():
        hf_state = to_hf(block_state)
        if torch.distributed.is_initialized():
            dcp.load(hf_state, storage_reader=reader)
        else:
            with _one_process():
                dcp.load(hf_state, storage_reader=reader, no_dist=True)
        with torch.no_grad():
            for key, value in from_hf(hf_state).items():
                if value is not state[key]:
                    state[key].copy_(value)
