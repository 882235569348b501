"""A clean run with every detector on reports nothing."""

import torch
from torch import nn

from ttnpu.sdc import (
    ChecksumMode,
    CollectiveChecker,
    GradientDetector,
    Reporter,
    SDCConfig,
    VetoFlag,
)

from .threaded import run_ranks


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v
        x = x + self.proj(attn)
        return x + self.mlp(x)


def test_clean_200_step_data_parallel_run_reports_nothing() -> None:
    def body(group: torch.distributed.ProcessGroup, rank: int) -> tuple[int, int, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(64, 16), _Block(16), nn.Linear(16, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        flag = VetoFlag()
        reporter = Reporter([flag], rank=rank)
        config = SDCConfig(grad_sample_interval=1)
        detector = GradientDetector(
            model.named_parameters(), config, reporter=reporter, accumulation_steps=2, group=group
        )
        comm = CollectiveChecker(group, reporter=reporter)
        g = torch.Generator().manual_seed(rank)
        with ChecksumMode(reporter=reporter) as mode:
            for step in range(200):
                reporter.step = step
                for _ in range(2):
                    tokens = torch.randint(64, (2, 12), generator=g)
                    logits = model(tokens[:, :-1])
                    loss = nn.functional.cross_entropy(
                        logits.flatten(0, 1), tokens[:, 1:].flatten()
                    )
                    loss.backward()
                    detector.after_backward()
                for p in model.parameters():
                    comm.all_reduce(p.grad)
                opt.step()
                opt.zero_grad()
        return len(flag.take()), mode.stats.checked, mode.stats.suspects

    for events, checked, suspects in run_ranks(2, body):
        assert events == 0 and suspects == 0
        assert checked > 200 * 2 * 10
