"""The DeepSeek-V4 transformer: embedding expanded to n mHC streams, blocks of (attention, MoE)
sites, hc_head collapse, final norm and head; plus the depth-1 multi-token-prediction block."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .attention import Attention
from .config import DeepSeekV4Config
from .context_parallel import ContextParallel, SequenceShard
from .mhc import hc_head, hc_post, hc_pre
from .moe import MoE, Router
from .norms import RMSNorm
from .rope import RopeTable, rope_frequencies

__all__ = ["Block", "DeepSeekV4", "LossTerms", "MTPBlock"]

IGNORE_INDEX = -100


def _cross_entropy_share(
    logits: torch.Tensor, labels: torch.Tensor, shard: SequenceShard
) -> torch.Tensor:
    """Mean next-token CE over the valid ``labels`` [B, S] of the whole sequence, of which
    ``logits`` [B, L, vocab] are this rank's slice: this rank's share of the mean."""
    local = shard.local(labels)
    total = F.cross_entropy(
        logits.flatten(0, 1).float(), local.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / (labels != IGNORE_INDEX).sum()


class LossTerms(NamedTuple):
    """``DeepSeekV4.losses``: ``total`` (what ``loss`` returns) and its unweighted parts; a part
    the model does not have is a zero. A NamedTuple, so FSDP2 sees the tensors in it."""

    total: torch.Tensor
    lm: torch.Tensor  # main-head next-token CE
    mtp: torch.Tensor  # MTP CE (mean over MTP blocks)
    balance: torch.Tensor  # summed sequence balance losses of the learned-gate MoE layers
    indexer: torch.Tensor  # summed lightning-indexer KL losses of the CSA layers


def _hc_site_params(n: int, dim: int) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    mix = (2 + n) * n
    return (
        nn.Parameter(torch.empty(mix, n * dim, dtype=torch.float32)),
        nn.Parameter(torch.zeros(mix, dtype=torch.float32)),
        nn.Parameter(torch.ones(3, dtype=torch.float32)),
    )


@contextmanager
def _drawn_full_size(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within: the modules' own DTensor parameters (FSDP or EP shards) are stood in for by plain
    full-size tensors, so an init draws exactly the random numbers it draws unsharded; on a
    normal exit each rank copies its shard of them in. Ranks seeded alike get one model, equal
    to the unsharded init: no DTensor random ops (not shard-exact on every device)."""
    sharded = [
        (module, name, param)
        for module in modules
        for name, param in module.named_parameters(recurse=False)
        if isinstance(param, DTensor)
    ]
    for module, name, param in sharded:
        local = param.to_local()
        stand_in = torch.empty(param.shape, dtype=local.dtype, device=local.device)
        setattr(module, name, nn.Parameter(stand_in, requires_grad=param.requires_grad))
    try:
        yield
        for module, name, param in sharded:
            full = getattr(module, name).detach()
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
    finally:
        for module, name, param in sharded:
            setattr(module, name, param)


class Block(nn.Module):
    """Two mHC sites: attention then MoE, each ``X' = post * F(norm(pre . X)) + comb^T X``."""

    def __init__(self, config: DeepSeekV4Config, layer_id: int, ratio: int, *, hash_routed: bool):
        super().__init__()
        self.layer_id, self.ratio = layer_id, ratio
        self.hc_iters, self.hc_eps, self.norm_eps = (
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.norm_eps,
        )
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config, ratio)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = MoE(config, hash_routed=hash_routed)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _hc_site_params(
            config.hc_mult, config.dim
        )
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _hc_site_params(
            config.hc_mult, config.dim
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTable,
        token_ids: torch.Tensor,
        shard: SequenceShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Streams [B, S, n, dim] -> (new streams, this MoE's balance loss or None if hashed, the
        indexer loss or None if not CSA). The losses are returned, not collected through an
        argument: FSDP may copy arguments. ``shard``: see :class:`Attention`."""
        attn_site = self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale
        u, post, comb = self._pre(x, *attn_site, self.attn_norm)
        out, indexer_loss = self.attn(u, rope, shard)
        x = hc_post(out, x, post, comb)
        ffn_site = self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale
        u, post, comb = self._pre(x, *ffn_site, self.ffn_norm)
        y, balance = self.ffn(u, token_ids, shard)
        return hc_post(y, x, post, comb), balance, indexer_loss

    def _pre(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The site's mixes and its sub-layer input, normalised by ``norm`` (fused)."""
        return hc_pre(
            x,
            fn,
            base,
            scale,
            iters=self.hc_iters,
            eps=self.hc_eps,
            norm_eps=self.norm_eps,
            norm_weight=norm.weight,
        )

    def reset_parameters(self, std: float, hc_scale: float) -> None:
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attn.reset_parameters(std)
        self.ffn.reset_parameters(std)
        for fn, base, scale in (
            (self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale),
            (self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale),
        ):
            nn.init.normal_(fn, std=std)
            nn.init.zeros_(base)
            nn.init.constant_(scale, hc_scale)


class MTPBlock(Block):
    """Depth-1 MTP: ``e_proj(enorm(emb(t_{i+1}))) + h_proj(hnorm(X_i))`` through a sliding-window
    block with a learned gate, then its own hc_head and norm (embedding and head are shared)."""

    def __init__(self, config: DeepSeekV4Config, layer_id: int) -> None:
        super().__init__(config, layer_id, 0, hash_routed=False)
        self.e_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.h_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.enorm = RMSNorm(config.dim, config.norm_eps)
        self.hnorm = RMSNorm(config.dim, config.norm_eps)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.hc_head_fn = nn.Parameter(
            torch.empty(config.hc_mult, config.hc_mult * config.dim, dtype=torch.float32)
        )
        self.hc_head_base = nn.Parameter(torch.zeros(config.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def predict(
        self,
        streams: torch.Tensor,
        next_embedding: torch.Tensor,
        rope: RopeTable,
        token_ids: torch.Tensor,
        shard: SequenceShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(The normalised hidden state [B, S, dim] the shared head turns into MTP logits, the
        block's balance loss)."""
        x = self.e_proj(self.enorm(next_embedding)).unsqueeze(-2) + self.h_proj(self.hnorm(streams))
        x, balance, _ = self.forward(x, rope, token_ids, shard)  # sliding window: no indexer
        collapsed = hc_head(
            x,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            eps=self.hc_eps,
            norm_eps=self.norm_eps,
            norm_weight=self.norm.weight,
        )
        return collapsed, balance

    def reset_parameters(self, std: float, hc_scale: float) -> None:
        super().reset_parameters(std, hc_scale)
        for linear in (self.e_proj, self.h_proj):
            nn.init.normal_(linear.weight, std=std)
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.normal_(self.hc_head_fn, std=std)
        nn.init.zeros_(self.hc_head_base)
        nn.init.constant_(self.hc_head_scale, hc_scale)


class DeepSeekV4(nn.Module):
    """``model(tokens)`` -> main-head logits; ``model.loss(tokens, labels)`` -> training loss.

    With ``context_parallel`` set (:func:`ttnpu.dsv4.parallel.apply_context_parallel`) every rank
    of the CP group is given the same whole sequences and computes its slice of them: the logits
    are the slice's, and each loss is this rank's share (the group's shares sum to the loss)."""

    main_inv_freq: torch.Tensor
    compress_inv_freq: torch.Tensor
    context_parallel: ContextParallel | None = None

    def __init__(self, config: DeepSeekV4Config) -> None:
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(
            Block(c, i, ratio, hash_routed=c.is_hash_layer(i))
            for i, ratio in enumerate(c.compress_ratios)
        )
        self.mtp = nn.ModuleList(MTPBlock(c, c.n_layers + i) for i in range(c.n_mtp_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(
            torch.empty(c.hc_mult, c.hc_mult * c.dim, dtype=torch.float32)
        )
        self.hc_head_base = nn.Parameter(torch.zeros(c.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        main, compress = self._inv_freqs()
        self.register_buffer("main_inv_freq", main, persistent=False)
        self.register_buffer("compress_inv_freq", compress, persistent=False)
        for name, module in self.named_modules():
            if isinstance(module, Router):
                module.name = name
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, init_std) matrices, unit norms, zero sinks/ape/bias, mHC scale ``hc_init_scale``,
        the fixed-seed hash table. Deterministic under ``torch.manual_seed``; a sharded model
        (FSDP, expert parallel) gets the shards of the unsharded init on every rank, drawn one
        block at a time at full size."""
        c = self.config
        with torch.no_grad():
            with _drawn_full_size([self, self.embed, self.head, *self.norm.modules()]):
                nn.init.normal_(self.embed.weight, std=c.init_std)
                nn.init.normal_(self.head.weight, std=c.init_std)
                self.norm.reset_parameters()
                nn.init.normal_(self.hc_head_fn, std=c.init_std)
                nn.init.zeros_(self.hc_head_base)
                nn.init.constant_(self.hc_head_scale, c.hc_init_scale)
            for block in [*self.layers, *self.mtp]:
                with _drawn_full_size(block.modules()):
                    block.reset_parameters(c.init_std, c.hc_init_scale)
            if not self.main_inv_freq.is_meta:  # recomputed: to_empty() leaves buffers garbage
                main, compress = self._inv_freqs()
                self.main_inv_freq.copy_(main)
                self.compress_inv_freq.copy_(compress)

    def _inv_freqs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE frequencies: main (SWA layers, MTP) and compress (CSA/HCA, YaRN if enabled)."""
        c = self.config
        main = rope_frequencies(c.rope_head_dim, c.rope_theta)
        if not c.use_yarn:
            return main, rope_frequencies(c.rope_head_dim, c.compress_rope_theta)
        compress = rope_frequencies(
            c.rope_head_dim,
            c.compress_rope_theta,
            yarn_factor=c.rope_factor,
            original_seq_len=c.original_seq_len,
            beta_fast=c.beta_fast,
            beta_slow=c.beta_slow,
        )
        return main, compress

    # Forward ---------------------------------------------------------------------------------
    def shard(self, seq_len: int) -> SequenceShard:
        """This rank's slice of a sequence of ``seq_len`` tokens (all of it without CP)."""
        if self.context_parallel is None:
            return SequenceShard.whole(seq_len)
        return self.context_parallel.shard(seq_len)

    def _rope_tables(
        self, shard: SequenceShard, device: torch.device
    ) -> tuple[RopeTable, RopeTable]:
        size = shard.stop - shard.start
        return (
            RopeTable.build(self.main_inv_freq, size, device, shard.start),
            RopeTable.build(self.compress_inv_freq, size, device, shard.start),
        )

    def body(
        self, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The n-stream state [B, L, n, dim] of this rank's slice (L = S without CP) after the
        last main block, the learned-gate layers' balance losses and the CSA layers' indexer
        losses."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a LongTensor [B, S], got {tokens.dtype} {list(tokens.shape)}"
            )
        shard = self.shard(tokens.shape[1])
        main, compress = self._rope_tables(shard, tokens.device)
        tokens = shard.local(tokens)
        x = self.embed(tokens).unsqueeze(-2).expand(-1, -1, self.config.hc_mult, -1)
        balances, indexer_losses = [], []
        for block in self.layers:
            x, balance, indexer_loss = block(x, compress if block.ratio else main, tokens, shard)
            if balance is not None:
                balances.append(balance)
            if indexer_loss is not None:
                indexer_losses.append(indexer_loss)
        return x, balances, indexer_losses

    def _logits(self, streams: torch.Tensor) -> torch.Tensor:
        collapsed = hc_head(
            streams,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            eps=self.config.hc_eps,
            norm_eps=self.config.norm_eps,
            norm_weight=self.norm.weight,
        )
        return self.head(collapsed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> main-head logits [B, L, vocab] (this rank's slice; L = S without
        CP)."""
        return self._logits(self.body(tokens)[0])

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss: ``losses(tokens, labels).total``."""
        return self._loss_terms(tokens, labels).total

    def losses(self, tokens: torch.Tensor, labels: torch.Tensor) -> LossTerms:
        """The training loss and its parts (for logging), from one forward. Both ``loss`` and
        this call ``_loss_terms`` (not each other), so each can be an FSDP forward method."""
        return self._loss_terms(tokens, labels)

    def _loss_terms(self, tokens: torch.Tensor, labels: torch.Tensor) -> LossTerms:
        """Next-token CE + ``mtp_loss_weight`` x MTP CE + ``balance_loss_coef`` x the summed
        sequence balance losses + ``indexer_loss_weight`` x the summed indexer KL losses.
        ``labels[b, i]`` is the target of position i (-100 = ignore). The indexer loss reaches
        only the indexers (their inputs and target are detached); in the dense warm-up stage
        the other terms are detached, so only the indexers train."""
        if labels.shape != tokens.shape:
            raise ValueError(f"labels {list(labels.shape)} must match tokens {list(tokens.shape)}")
        c = self.config
        shard = self.shard(tokens.shape[1])
        streams, balances, indexer_losses = self.body(tokens)
        lm = _cross_entropy_share(self._logits(streams), labels, shard)
        zero = lm.new_zeros(())
        mtp = zero
        if self.mtp and tokens.shape[1] > 1:
            main_rope, _ = self._rope_tables(shard, tokens.device)
            # Position i sees t_{i+1} (= labels[i]) and predicts t_{i+2} (= labels[i+1]); where
            # labels[i] is ignored it sees a placeholder, so it is not trained there either.
            target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            target = target.masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)
            next_embedding = self.embed(shard.local(labels).clamp(min=0))
            local_tokens = shard.local(tokens)
            for block in cast(list[MTPBlock], list(self.mtp)):
                hidden, balance = block.predict(
                    streams, next_embedding, main_rope, local_tokens, shard
                )
                balances += [] if balance is None else [balance]
                mtp_logits = self.head.forward(hidden)
                mtp = mtp + _cross_entropy_share(mtp_logits, target, shard) / len(self.mtp)
        balance = torch.stack(balances).sum() if balances else zero
        indexer = torch.stack(indexer_losses).sum() if indexer_losses else zero
        model_loss = lm
        if self.mtp and tokens.shape[1] > 1:
            model_loss = model_loss + c.mtp_loss_weight * mtp
        if balances and c.balance_loss_coef:
            model_loss = model_loss + c.balance_loss_coef * balance
        if c.indexer_stage == "dense":
            model_loss = model_loss.detach()
        total = model_loss
        if indexer_losses and c.indexer_loss_weight:
            total = total + c.indexer_loss_weight * indexer
        return LossTerms(total, lm, mtp, balance, indexer)

    def routers(self) -> list[Router]:
        """The learned-gate routers (main layers, then MTP), as found by ``named_modules``."""
        return [m for m in self.modules() if isinstance(m, Router)]

    def reset_step_state(self) -> None:
        """Zero every MoE's step counters."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_step_state()
