"""DeepSeek-V4 hyper-parameters: flavors from a tiny debug model to Flash and Pro, and the
official / Hugging Face ``config.json`` mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = ["AttentionBackend", "DeepSeekV4Config", "IndexerStage"]

# How the attention core is computed (ttnpu.dsv4.backends); every backend computes one function.
AttentionBackend = Literal["reference", "chunked", "flex", "npu"]

# Lightning-indexer training stage: "dense" warm-up (CSA reads every visible compressed entry, the
# KL covers all of them, only the indexer trains) or "sparse" (top-k reads, KL on the selection).
IndexerStage = Literal["dense", "sparse"]

_BACKENDS = get_args(AttentionBackend)

# The overlapping compressor plus lightning indexer is built exactly for this ratio (official rule).
CSA_RATIO = 4


@dataclass
class DeepSeekV4Config:
    """Every field of the architecture; names follow the official ``inference`` ModelArgs."""

    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # One ratio per main layer: 0 = sliding window only, 4 = CSA (overlap + indexer), other = HCA.
    compress_ratios: tuple[int, ...] = (0, 0, *(4, 128) * 20, 4)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2048
    n_hash_layers: int = 3
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN on the compress RoPE table (CSA/HCA layers); off for short-context from-scratch runs.
    use_yarn: bool = True
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    max_seq_len: int = 1048576
    n_mtp_layers: int = 1
    mtp_loss_weight: float = 0.3
    balance_loss_coef: float = 1e-4
    indexer_stage: IndexerStage = "sparse"
    indexer_loss_weight: float = 1.0
    # Not architecture (not in config.json): how the attention is computed. "chunked" bounds
    # memory on any device; "reference" is the dense masked statement (parity tests); "flex"
    # (CUDA) and "npu" (Ascend) use fused kernels.
    attention_backend: AttentionBackend = "chunked"
    # The chunked backend's budget: at most this many logits (queries x heads x keys) per chunk:
    # 256 MiB of fp32 scores, a few such transients while a chunk is (re)computed; a Flash HCA
    # layer of a 1M-token CP 128 rank runs 67 chunks (265 at 2^24).
    attention_chunk_logits: int = 1 << 26
    # The indexer's top-k selection budget: at most this many index scores (queries x index
    # heads x entries) per step. Selected under no_grad and freed at once, so it can be larger
    # than a chunk: fewer, larger steps (a Flash CSA layer of a 1M-token CP 128 rank takes 512
    # steps instead of 8,192 at 2^24).
    index_select_logits: int = 1 << 28
    init_std: float = 0.02
    hc_init_scale: float = 0.01
    hash_seed: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    extra_hf_fields: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.compress_ratios = tuple(int(r) for r in self.compress_ratios)
        checks = [
            (
                len(self.compress_ratios) == self.n_layers,
                "compress_ratios needs one entry per layer",
            ),
            (all(r >= 0 for r in self.compress_ratios), "compress_ratios must be >= 0"),
            (self.n_heads % self.o_groups == 0, "n_heads must be divisible by o_groups"),
            (0 < self.rope_head_dim <= self.head_dim, "rope_head_dim must be in (0, head_dim]"),
            (self.rope_head_dim % 2 == 0, "rope_head_dim must be even"),
            (self.rope_head_dim <= self.index_head_dim, "rope_head_dim must be <= index_head_dim"),
            (0 < self.n_activated_experts <= self.n_routed_experts, "need 0 < top-k <= experts"),
            (0 <= self.n_hash_layers <= self.n_layers, "n_hash_layers must be in [0, n_layers]"),
            (self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "hc_mult, iters must be >= 1"),
            (self.window_size >= 1, "window_size must be >= 1"),
            (self.n_mtp_layers in (0, 1), "n_mtp_layers must be 0 or 1 (MTP depth 1)"),
            (
                self.indexer_stage in ("dense", "sparse"),
                f"indexer_stage must be 'dense' or 'sparse', got {self.indexer_stage!r}",
            ),
            (self.indexer_loss_weight >= 0, "indexer_loss_weight must be >= 0"),
            (
                self.attention_backend in _BACKENDS,
                f"attention_backend must be one of {list(_BACKENDS)}, "
                f"got {self.attention_backend!r}",
            ),
            (self.attention_chunk_logits >= 1, "attention_chunk_logits must be >= 1"),
            (self.index_select_logits >= 1, "index_select_logits must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DeepSeekV4Config: {message}")

    # Layer kinds -----------------------------------------------------------------------------
    def is_csa(self, ratio: int) -> bool:
        return ratio == CSA_RATIO

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.n_hash_layers

    # Flavors ---------------------------------------------------------------------------------
    @classmethod
    def from_flavor(cls, name: str) -> DeepSeekV4Config:
        """``micro`` (for multi-process tests: every mechanism, dim 64), ``debug`` (the spec's tiny
        preset, every mechanism active), ``small`` (benchmarks), ``flash``, ``pro``."""
        flavors = {"micro": _micro, "debug": _debug, "small": _small, "flash": _flash, "pro": _pro}
        if name not in flavors:
            raise ValueError(
                f"unknown DeepSeek-V4 flavor {name!r}; expected one of {sorted(flavors)}"
            )
        return flavors[name]()

    # Hugging Face / official config.json ------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> DeepSeekV4Config:
        """Read the official ``config.json`` (legacy keys) or a transformers DeepseekV4 config."""
        try:
            n_layers = int(hf["num_hidden_layers"])
            ratios = _ratios_from_hf(hf, n_layers)
            rope_scaling: dict[str, Any] = hf.get("rope_scaling") or _hf_compress_rope(hf) or {}
            use_yarn = rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn"
            head_dim = int(hf["head_dim"])
            rope_dim = int(
                hf.get("qk_rope_head_dim")
                or round(head_dim * float(hf.get("partial_rotary_factor") or 0.125))
            )
            mlp_types = hf.get("mlp_layer_types")
            n_hash = (
                sum(t == "hash_moe" for t in mlp_types)
                if mlp_types
                else int(hf.get("num_hash_layers", hf.get("n_hash_layers", 3)))
            )
            kwargs: dict[str, Any] = dict(
                vocab_size=int(hf["vocab_size"]),
                dim=int(hf["hidden_size"]),
                n_layers=n_layers,
                n_heads=int(hf["num_attention_heads"]),
                head_dim=head_dim,
                rope_head_dim=rope_dim,
                q_lora_rank=int(hf["q_lora_rank"]),
                o_groups=int(hf["o_groups"]),
                o_lora_rank=int(hf["o_lora_rank"]),
                window_size=int(hf["sliding_window"]),
                compress_ratios=ratios,
                index_n_heads=int(hf["index_n_heads"]),
                index_head_dim=int(hf["index_head_dim"]),
                index_topk=int(hf["index_topk"]),
                n_routed_experts=int(hf["n_routed_experts"]),
                n_shared_experts=int(hf.get("n_shared_experts", 1)),
                n_activated_experts=int(hf["num_experts_per_tok"]),
                moe_inter_dim=int(hf["moe_intermediate_size"]),
                n_hash_layers=n_hash,
                route_scale=float(hf.get("routed_scaling_factor", 1.5)),
                swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
                hc_mult=int(hf.get("hc_mult", 4)),
                hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
                hc_eps=float(hf.get("hc_eps", 1e-6)),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                compress_rope_theta=float(hf.get("compress_rope_theta", 160000.0)),
                use_yarn=use_yarn,
                max_seq_len=int(hf.get("max_position_embeddings", 1048576)),
                n_mtp_layers=int(hf.get("num_nextn_predict_layers", 1)),
                bos_token_id=int(hf.get("bos_token_id", 0) or 0),
                eos_token_id=int(_first(hf.get("eos_token_id", 1))),
                init_std=float(hf.get("initializer_range", 0.02)),
            )
            if use_yarn:
                kwargs.update(
                    rope_factor=float(rope_scaling["factor"]),
                    original_seq_len=int(rope_scaling["original_max_position_embeddings"]),
                    beta_fast=int(rope_scaling.get("beta_fast", 32)),
                    beta_slow=int(rope_scaling.get("beta_slow", 1)),
                )
        except KeyError as err:
            raise ValueError(f"DeepSeek-V4 config.json is missing field {err.args[0]!r}") from err
        known = _HF_KEYS_READ
        kwargs["extra_hf_fields"] = {k: v for k, v in hf.items() if k not in known}
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """Official ``config.json`` fields, plus the transformers names for the layer schedule."""
        ratios = [*self.compress_ratios, *([0] * self.n_mtp_layers)]
        csa = [r for r in self.compress_ratios if self.is_csa(r)]
        hca = [r for r in self.compress_ratios if r and not self.is_csa(r)]
        if len(set(hca)) > 1:
            raise ValueError("to_hf_config: transformers needs a single HCA compression ratio")
        out: dict[str, Any] = {
            **self.extra_hf_fields,
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "compress_ratios": ratios,
            "layer_types": [_HF_LAYER_TYPE[self._kind(r)] for r in self.compress_ratios],
            "compress_rates": {
                "compressed_sparse_attention": csa[0] if csa else CSA_RATIO,
                "heavily_compressed_attention": hca[0] if hca else 128,
            },
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "moe_intermediate_size": self.moe_inter_dim,
            "num_hash_layers": self.n_hash_layers,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": self.route_scale,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_seq_len,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "initializer_range": self.init_std,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.use_yarn:
            out["rope_scaling"] = {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
            }
        return out

    def _kind(self, ratio: int) -> str:
        return "swa" if ratio == 0 else "csa" if self.is_csa(ratio) else "hca"

    def replace(self, **changes: Any) -> DeepSeekV4Config:
        return dataclasses.replace(self, **changes)


_HF_LAYER_TYPE = {
    "swa": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}
_HF_KEYS_READ = {
    "num_hidden_layers", "compress_ratios", "layer_types", "compress_rates", "rope_scaling",
    "rope_parameters", "head_dim", "qk_rope_head_dim", "partial_rotary_factor", "mlp_layer_types",
    "num_hash_layers", "n_hash_layers", "vocab_size", "hidden_size", "num_attention_heads",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
    "index_topk", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "routed_scaling_factor", "swiglu_limit", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta",
    "max_position_embeddings", "num_nextn_predict_layers", "bos_token_id", "eos_token_id",
    "initializer_range", "architectures", "model_type", "num_key_value_heads", "scoring_func",
    "topk_method", "norm_topk_prob", "hidden_act", "tie_word_embeddings",
}  # fmt: skip


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def _hf_compress_rope(hf: dict[str, Any]) -> dict[str, Any] | None:
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        compress: dict[str, Any] = params["compress"]
        return compress
    return None


def _ratios_from_hf(hf: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    if hf.get("layer_types"):
        rates = {"compressed_sparse_attention": CSA_RATIO, "heavily_compressed_attention": 128}
        rates.update(hf.get("compress_rates") or {})
        rates["sliding_attention"] = 0
        return tuple(int(rates[t]) for t in hf["layer_types"][:n_layers])
    ratios = hf["compress_ratios"]
    if len(ratios) < n_layers:
        raise ValueError(
            f"config.json compress_ratios has {len(ratios)} entries, expected >= {n_layers}"
        )
    return tuple(int(r) for r in ratios[:n_layers])


def _debug() -> DeepSeekV4Config:
    return DeepSeekV4Config(
        vocab_size=2048,
        dim=256,
        n_layers=7,
        n_heads=4,
        head_dim=128,
        rope_head_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        window_size=32,
        compress_ratios=(0, 0, 4, 16, 4, 16, 4),
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        n_routed_experts=16,
        n_activated_experts=4,
        moe_inter_dim=128,
        use_yarn=False,
        max_seq_len=4096,
    )


def _micro() -> DeepSeekV4Config:
    return _debug().replace(
        vocab_size=128,
        dim=64,
        n_layers=4,
        compress_ratios=(0, 4, 8, 4),
        n_heads=2,
        head_dim=32,
        rope_head_dim=8,
        q_lora_rank=32,
        o_lora_rank=16,
        window_size=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        n_routed_experts=8,
        n_activated_experts=2,
        moe_inter_dim=32,
        n_hash_layers=1,
    )


def _small() -> DeepSeekV4Config:
    return DeepSeekV4Config(
        vocab_size=8192,
        dim=512,
        n_layers=8,
        n_heads=8,
        head_dim=128,
        rope_head_dim=16,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=256,
        window_size=64,
        compress_ratios=(0, 0, 4, 32, 4, 32, 4, 32),
        index_n_heads=8,
        index_head_dim=64,
        index_topk=32,
        n_routed_experts=32,
        n_activated_experts=6,
        moe_inter_dim=256,
        use_yarn=False,
        max_seq_len=16384,
    )


def _flash() -> DeepSeekV4Config:
    return DeepSeekV4Config()


def _pro() -> DeepSeekV4Config:
    # Layer order and route_scale as in TorchTitan-NPU (unverified against Pro's config.json).
    return DeepSeekV4Config(
        dim=7168,
        n_layers=61,
        n_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        compress_ratios=(128, *(128, 4) * 30),
        index_topk=1024,
        n_routed_experts=384,
        moe_inter_dim=3072,
        route_scale=2.5,
    )
