"""A small MoE language model and a stateful synthetic corpus, for tests and the benchmark.

``TopKRouter`` is a reference implementation of the :class:`ttnpu.routing.Router` protocol in the
style of DeepSeek's learned gate (sqrt-softplus scores, a selection-only bias, a token-load buffer
updated in forward). The corpus is a fixed random Markov chain, so losses fall like real ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Learned-gate top-k router; ``force_indices`` replaces the choice, not the weights."""

    bias: torch.Tensor
    load: torch.Tensor

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("bias", torch.zeros(num_experts))
        self.register_buffer("load", torch.zeros(num_experts))
        self.last_indices: torch.Tensor | None = None
        self._forced: torch.Tensor | None = None

    def force_indices(self, indices: torch.Tensor | None) -> None:
        if indices is not None:
            if indices.dtype != torch.int64 or indices.dim() != 2 or indices.shape[1] != self.top_k:
                raise ValueError(
                    f"force_indices: expected [num_tokens, {self.top_k}] int64, got "
                    f"{list(indices.shape)} {indices.dtype}"
                )
            if indices.numel() and (indices.min() < 0 or indices.max() >= self.num_experts):
                raise ValueError(f"force_indices: indices outside 0..{self.num_experts - 1}")
        self._forced = indices

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(self.gate(x).float()).sqrt()
        if self._forced is None:
            indices = torch.topk(scores.detach() + self.bias, self.top_k, dim=-1).indices
        elif self._forced.shape[0] != x.shape[0]:
            raise ValueError(
                f"forced indices are for {self._forced.shape[0]} tokens, the input has {x.shape[0]}"
            )
        else:
            indices = self._forced
        weights = scores.gather(-1, indices)
        weights = weights / weights.sum(-1, keepdim=True)
        with torch.no_grad():
            self.load += torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        self.last_indices = indices
        return indices, weights.to(x.dtype)

    @torch.no_grad()
    def update_bias(self, speed: float = 1e-3) -> None:
        """Aux-loss-free balancing: nudge the selection bias towards the mean load."""
        self.bias += speed * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = TopKRouter(dim, num_experts, top_k)
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        indices, weights = self.router(x)
        out = torch.zeros_like(x)
        for e in range(self.router.num_experts):
            token, slot = (indices == e).nonzero(as_tuple=True)
            h = F.silu(x[token] @ self.w1[e].T) @ self.w2[e].T
            out = out.index_add(0, token, h * weights[token, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.moe = MoE(dim, hidden, num_experts, top_k)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.drop(self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        b, t, d = x.shape
        return x + self.drop(self.moe(self.norm2(x).reshape(b * t, d)).reshape(b, t, d))


class TinyMoE(nn.Module):
    """Decoder-only MoE LM: attention + learned-gate MoE per block, dropout, tied nothing."""

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        layers: int = 2,
        num_experts: int = 8,
        top_k: int = 2,
        hidden: int = 64,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            Block(dim, hidden, num_experts, top_k, dropout) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def update_router_biases(self, speed: float = 1e-3) -> None:
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.update_bias(speed)


class MarkovCorpus:
    """Deterministic batches of token sequences from a fixed random Markov chain.

    Batch ``i`` depends only on ``(seed, i)``; ``state_dict()`` is the index of the next batch,
    the contract of torchtitan's stateful dataloaders.
    """

    def __init__(
        self,
        *,
        batch: int = 8,
        seq: int = 33,
        vocab: int = 64,
        seed: int = 0,
        length: int | None = None,
    ) -> None:
        self.batch, self.seq, self.vocab, self.seed, self.length = batch, seq, vocab, seed, length
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        self.transitions = torch.softmax(logits, dim=-1)
        self.index = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.length is None or self.index < self.length:
            i = self.index
            self.index += 1
            yield self.batch_at(i)

    def batch_at(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 1)
        tokens = torch.empty(self.batch, self.seq, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab, (self.batch,), generator=g)
        for t in range(1, self.seq):
            tokens[:, t] = torch.multinomial(self.transitions[tokens[:, t - 1]], 1, generator=g)[
                :, 0
            ]
        return tokens

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = int(state_dict["index"])
