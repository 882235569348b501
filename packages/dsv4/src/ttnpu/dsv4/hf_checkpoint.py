"""transformers' DeepseekV4 checkpoints: the one name table between this package's state dict and
transformers' layout, and a torch.distributed.checkpoint reader that streams a safetensors folder
of either layout into it.

transformers names the modules its own way (``model.layers.{i}.self_attn.q_a_proj.weight``) and
stacks the routed experts as ``mlp.experts.gate_up_proj`` [E, 2I, D] (``w1`` then ``w3`` on dim 1)
and ``mlp.experts.down_proj`` [E, D, I]. Its ``save_pretrained`` writes official names under a
``model.`` prefix instead (one tensor per expert), which the reader accepts too. transformers has
no MTP; MTP blocks keep the ``mtp.{k}.`` prefix with the decoder-layer names inside it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import _getdtype
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

__all__ = [
    "CheckpointError",
    "HFCheckpointReader",
    "Source",
    "from_hf",
    "hf_name",
    "scan_checkpoint",
    "to_hf",
]

logger = logging.getLogger(__name__)

Source = Literal["auto", "official", "hf"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# ours (inside ``layers.{i}.`` and ``mtp.{k}.``) -> transformers (inside ``model.layers.{i}.``)
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{
        f"hc_{site}_{p}": f"{site}_hc.{p}"
        for site in ("attn", "ffn")
        for p in ("fn", "base", "scale")
    },
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.expert_bias": "mlp.gate.e_score_correction_bias",  # learned gates only
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.experts.w1": "mlp.experts.gate_up_proj",  # rows [:I] of dim 1
    "ffn.experts.w3": "mlp.experts.gate_up_proj",  # rows [I:] of dim 1
    "ffn.experts.w2": "mlp.experts.down_proj",
}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_MTP_ONLY = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"}
_MTP_ONLY |= {f"hc_head_{p}" for p in ("fn", "base", "scale")}
_BLOCK_FROM_HF = {hf: ours for ours, hf in _BLOCK.items() if not ours.endswith(("w1", "w3"))}
_TOP_FROM_HF = {hf: ours for ours, hf in _TOP.items()}
_GATE_UP = "mlp.experts.gate_up_proj"

_OURS_KEY = re.compile(r"^(layers\.\d+\.|mtp\.\d+\.)?(.+)$")
_HF_KEY = re.compile(r"^(model\.layers\.\d+\.|mtp\.\d+\.)?(.+)$")
_PER_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_GATE_BIAS = re.compile(r"^(.*\.ffn)\.gate\.bias$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: one line naming the missing, unexpected and
    wrongly shaped keys (the first few of each, with their counts)."""

    SHOWN = 8

    def __init__(
        self, missing: list[str], unexpected: list[str], mismatched: list[str], source: str
    ) -> None:
        parts = []
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrong shape", mismatched),
        ):
            if keys:
                more = f", ... ({len(keys) - self.SHOWN} more)" if len(keys) > self.SHOWN else ""
                parts.append(f"{label} ({len(keys)}): {', '.join(keys[: self.SHOWN])}{more}")
        super().__init__(f"checkpoint {source} does not match the model: {'; '.join(parts)}")
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched


def hf_name(key: str) -> str:
    """transformers' name for one of this package's state-dict keys (``ffn.experts.w1`` and
    ``w3`` both live in ``mlp.experts.gate_up_proj``). Raises KeyError for an unknown key."""
    block, rest = _split(_OURS_KEY, key)
    if not block:
        return _TOP[rest]
    prefix = f"model.{block}" if block.startswith("layers.") else block
    if block.startswith("mtp.") and rest in _MTP_ONLY:
        return key
    return prefix + _BLOCK[rest]


def _ours_name(key: str) -> str | None:
    """This package's key for a transformers name, None if it is not one (or is gate_up_proj)."""
    block, rest = _split(_HF_KEY, key)
    if not block:
        return _TOP_FROM_HF.get(rest)
    prefix = block.removeprefix("model.")
    if block.startswith("mtp.") and rest in _MTP_ONLY:
        return key
    ours = _BLOCK_FROM_HF.get(rest)
    return prefix + ours if ours else None


def _split(pattern: re.Pattern[str], key: str) -> tuple[str, str]:
    match = pattern.match(key)
    assert match is not None  # (.+) matches any non-empty key
    return match.group(1) or "", match.group(2)


def to_hf(state: Mapping[str, Any]) -> dict[str, Any]:
    """This package's state dict -> transformers' names and layout (tensors or DTensors; the
    stacked ``w1`` and ``w3`` are concatenated, every other value is passed through). Hash-routed
    layers' expert bias is dropped (transformers has none; it is zero and unused)."""
    hash_blocks = {k.removesuffix("ffn.gate.tid2eid") for k in state if k.endswith("gate.tid2eid")}
    out: dict[str, Any] = {}
    for key, value in state.items():
        block, rest = _split(_OURS_KEY, key)
        if rest == "ffn.experts.w3":
            continue
        if rest == "ffn.experts.w1":
            value = torch.cat([value, state[f"{block}ffn.experts.w3"]], dim=1)
        elif rest == "ffn.expert_bias" and block in hash_blocks:
            continue
        try:
            out[hf_name(key)] = value
        except KeyError:
            raise ValueError(f"to_hf: {key!r} is not a DeepSeek-V4 state-dict key") from None
    return out


def from_hf(state: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' names and layout -> this package's state dict (``gate_up_proj`` is split
    into views of ``w1`` and ``w3``). Hash-routed layers' expert bias is absent: it stays zero."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        block, rest = _split(_HF_KEY, key)
        if rest == _GATE_UP:
            ours = block.removeprefix("model.") + "ffn.experts."
            out[ours + "w1"], out[ours + "w3"] = value.split(value.shape[1] // 2, dim=1)
        elif (ours_key := _ours_name(key)) is not None:
            out[ours_key] = value
        else:
            raise ValueError(f"from_hf: {key!r} is not a transformers DeepseekV4 name")
    return out


# -- reading a folder -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Piece:
    """Where one tensor of the folder lands in transformers' layout."""

    file: str
    key: str  # its name in the file
    target: str  # transformers' name it is (part of)
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    expert: bool  # one expert's matrix, a [1, ...] slice of a stacked tensor


@dataclass
class Scan:
    """What a checkpoint folder holds: its layout, and every tensor placed in transformers'."""

    layout: Literal["official", "hf"]
    pieces: dict[str, list[_Piece]] = field(default_factory=dict)  # by target
    unknown: list[str] = field(default_factory=list)

    @property
    def has_mtp(self) -> bool:
        return any(t.startswith("mtp.") for t in self.pieces)


def scan_checkpoint(directory: str | Path, source: Source = "auto") -> Scan:
    """Read the tensor headers of the files the folder's ``model.safetensors.index.json`` names
    (or of its single ``model.safetensors``) and place each tensor in transformers' layout. The
    layout is detected from the names (transformers' start with ``model.`` or ``lm_head.``) unless
    ``source`` says it; ValueError if it is neither or not the one said."""
    path = Path(directory)
    by_file = _weight_map(path)
    keys = [k for ks in by_file.values() for k in ks]
    if not keys:
        raise ValueError(f"{path} holds no tensors")
    layout: Literal["official", "hf"] = (
        "hf" if any(k.startswith(("model.", "lm_head.")) for k in keys) else "official"
    )
    if source != "auto" and source != layout:
        said = "transformers'" if source == "hf" else "official"
        raise ValueError(
            f"{path} does not hold {said} DeepSeek-V4 names (it holds "
            f"{'transformers' if layout == 'hf' else 'official'} ones, e.g. {keys[0]!r})"
        )
    scan = Scan(layout)
    for file, names in by_file.items():
        with safe_open(path / file, framework="pt") as handle:
            for key in names:
                piece = _place(file, key, handle.get_slice(key), layout)
                if piece is None:
                    scan.unknown.append(key)
                else:
                    scan.pieces.setdefault(piece.target, []).append(piece)
    if not scan.pieces:
        raise ValueError(
            f"{path} is not a DeepSeek-V4 checkpoint: none of its {len(keys)} tensor names is an "
            f"official or a transformers DeepseekV4 name (e.g. {keys[0]!r})"
        )
    return scan


def _weight_map(path: Path) -> dict[str, list[str]]:
    """{file: tensor names} from the index, or the single file's names; nothing else is read."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"{index} is not a safetensors index (no weight_map)") from err
        by_file: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            by_file.setdefault(file, []).append(key)
        if absent := sorted(f for f in by_file if not (path / f).is_file()):
            raise FileNotFoundError(f"{index} names files that are not there: {', '.join(absent)}")
        return by_file
    if (path / SINGLE).is_file():
        with safe_open(path / SINGLE, framework="pt") as handle:
            return {SINGLE: list(handle.keys())}
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    raise FileNotFoundError(f"no {INDEX} or {SINGLE} in {path}")


def _place(file: str, key: str, tensor: Any, layout: str) -> _Piece | None:
    shape, dtype = tuple(tensor.get_shape()), _getdtype(tensor.get_dtype())
    if layout == "hf":
        # transformers re-saves a model loaded from its own names with some renames undone
        native = key.replace(".norm.", ".kv_norm.") if ".self_attn." in key else key
        if _split(_HF_KEY, native)[1] == _GATE_UP or _ours_name(native) is not None:
            return _Piece(file, key, native, (0,) * len(shape), shape, dtype, expert=False)
        key_ours = key.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")
    else:
        key_ours = key  # official names are ours but for the experts and the gate bias
    if per := _PER_EXPERT.match(key_ours):
        prefix, j, name = per.groups()
        row = shape[0] if name == "w3" else 0  # w3 is the second half of gate_up_proj
        target = hf_name(f"{prefix}.{name}")
        return _Piece(file, key, target, (int(j), row, 0), (1, *shape), dtype, expert=True)
    if bias := _GATE_BIAS.match(key_ours):
        key_ours = f"{bias.group(1)}.expert_bias"
    try:
        target = hf_name(key_ours)
    except KeyError:
        return None
    if target.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return None  # a stacked tensor under an official name: not a layout we know
    return _Piece(file, key, target, (0,) * len(shape), shape, dtype, expert=False)


class HFCheckpointReader(HuggingFaceStorageReader):
    """torch.distributed.checkpoint reader of a DeepSeek-V4 safetensors folder (official or
    transformers names) that serves transformers' layout (:func:`to_hf` of the model's state
    dict): each rank reads only the slices its (sharded) tensors need, one expert's matrix at a
    time where the folder stores them one by one, and only from the files the index names.

    Everything is checked when the reader is made, before any tensor changes: a missing,
    unexpected or wrongly shaped key raises :class:`CheckpointError`. MTP weights may be absent
    (transformers saves none): the model's MTP tensors are then left as they are, with a warning.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        expected: Mapping[str, torch.Size],
        *,
        source: Source = "auto",
        scan: Scan | None = None,
    ) -> None:
        super().__init__(str(path))
        self.directory = Path(path)
        self.expected = dict(expected)
        self.scan = scan or scan_checkpoint(self.directory, source)
        self.kept = self._check(self.scan)

    def read_metadata(self) -> Metadata:
        tensors: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _Piece | None] = {}
        for target, pieces in self.scan.pieces.items():
            chunks = [
                ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in pieces
            ]
            props = TensorProperties(dtype=pieces[0].dtype)
            tensors[target] = TensorStorageMetadata(props, self.expected[target], chunks)
            storage.update({MetadataIndex(target, p.offsets): p for p in pieces})
        for target in self.kept:  # served as they are: read_data leaves them untouched
            shape = self.expected[target]
            whole = ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)
            tensors[target] = TensorStorageMetadata(TensorProperties(), shape, [whole])
            storage[MetadataIndex(target, whole.offsets)] = None
        metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)  # type: ignore[arg-type]
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def _check(self, scan: Scan) -> list[str]:
        """Raise CheckpointError unless the folder fits ``expected``; return the MTP targets the
        folder lacks (kept as they are)."""
        missing: list[str] = []
        unexpected, mismatched = list(scan.unknown), []
        for target, pieces in scan.pieces.items():
            shape = self.expected.get(target)
            if shape is None:
                unexpected += [p.key for p in pieces]
                continue
            for piece in pieces:
                if piece.expert and piece.offsets[0] >= shape[0]:
                    unexpected.append(piece.key)  # an expert the model does not have
                    continue
                want, got = list(shape), list(piece.sizes)
                if piece.expert:  # one expert's matrix: [I, D] of gate_up_proj's [E, 2I, D]
                    halves = 2 if target.endswith(_GATE_UP) else 1
                    want, got = [shape[1] // halves, *shape[2:]], got[1:]
                if got != want:
                    mismatched.append(f"{piece.key} {got} != {want}")
            missing += _uncovered(target, pieces, shape, scan.layout)
        absent = sorted(self.expected.keys() - scan.pieces.keys())
        kept = [t for t in absent if t.startswith("mtp.")] if not scan.has_mtp else []
        missing += [_spelled(t, scan.layout) for t in absent if t not in kept]
        if missing or unexpected or mismatched:
            raise CheckpointError(
                sorted(missing), sorted(unexpected), sorted(mismatched), str(self.directory)
            )
        if kept:
            logger.warning(
                "%s has no MTP weights (transformers' DeepseekV4 saves none): the %d MTP "
                "tensors keep their current values",
                self.directory,
                len(kept),
            )
        return kept

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[tuple[Any, _Piece]]] = {}
        for item in plan.items:
            piece = self.storage_data[item.storage_index]
            if piece is not None:
                by_file.setdefault(piece.file, []).append((item, piece))
        for file, items in by_file.items():
            with safe_open(self.directory / file, framework="pt") as handle:
                for item, piece in items:
                    ranges = [
                        slice(o, o + n)
                        for o, n in zip(item.storage_offsets, item.lengths, strict=True)
                    ]
                    data = handle.get_slice(piece.key)[
                        tuple(ranges[1:] if piece.expert else ranges)
                    ]
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(data.reshape(target.shape))
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _uncovered(target: str, pieces: list[_Piece], shape: torch.Size, layout: str) -> Iterable[str]:
    """Names of the experts a stacked ``target`` lacks when the folder stores them one by one."""
    if not any(p.expert for p in pieces):
        return []
    have = {(p.offsets[0], p.offsets[1] > 0) for p in pieces}
    parts = {False: "w1", True: "w3"} if target.endswith(_GATE_UP) else {False: "w2"}
    block = target.removeprefix("model.").split("mlp.")[0]
    prefix = "model." if layout == "hf" and block.startswith("layers.") else ""
    return [
        f"{prefix}{block}ffn.experts.{j}.{name}.weight"
        for j in range(shape[0])
        for second, name in parts.items()
        if (j, second) not in have
    ]


def _spelled(target: str, layout: str) -> str:
    """A missing transformers name as the folder's layout spells it."""
    if layout == "hf":
        return target
    block, rest = _split(_HF_KEY, target)
    if rest == _GATE_UP or rest == "mlp.experts.down_proj":
        w = "w1, w3" if rest == _GATE_UP else "w2"
        return f"{block.removeprefix('model.')}ffn.experts.<j>.{{{w}}}.weight"
    ours = _ours_name(target) or target
    if ours.endswith(".ffn.expert_bias"):
        return ours.removesuffix("expert_bias") + "gate.bias"
    return ours
