"""Train with matmul checksums and gradient detection; an injected bit flip is caught, its update
skipped, and every event is kept as a JSON line."""

import contextlib
import tempfile
from pathlib import Path

import torch
from torch import nn

from ttnpu.sdc import (
    BitFlip,
    ChecksumMode,
    EventLog,
    FaultPlan,
    GradientDetector,
    MatmulFaultMode,
    Reporter,
    SDCConfig,
    VetoFlag,
    checksum_switch,
    set_default_reporter,
)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
target = torch.randn(32, 1)
loader = [[torch.randn(16, 32) for _ in range(4)] for _ in range(8)]  # 8 steps x 4 micro-batches


def loss_fn(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), x @ target)


def drill(step: int, micro: int) -> contextlib.AbstractContextManager[object]:
    """Real faults come unannounced; this one flips an exponent bit in one matmul of step 5."""
    if (step, micro) != (5, 2):
        return contextlib.nullcontext()
    return MatmulFaultMode(FaultPlan([BitFlip(index=7, bit=29)], phase="forward"))


events = EventLog(Path(tempfile.mkdtemp()) / "sdc-events.jsonl")
veto = VetoFlag()
reporter = Reporter([events, veto])
set_default_reporter(reporter)  # the default one logs and raises
detector = GradientDetector(model.named_parameters(), SDCConfig(), accumulation_steps=4)
checksum_switch.on()  # check every matmul (on accelerators: off until a strike turns it on)
for step, micro_batches in enumerate(loader, start=1):
    reporter.step = step  # events carry it
    for micro, batch in enumerate(micro_batches):
        with drill(step, micro), ChecksumMode():  # or install_checksum_pass() + torch.compile
            loss = loss_fn(batch)
            loss.backward()
        detector.after_backward()  # judges the gradients after the 4th micro-batch
    if found := veto.take():  # an SDC event: skip this update
        optimizer.zero_grad()
        for e in found:
            verdict = e.detail.get("verdict", "unconfirmed")
            print(
                f"step {step}: skipped ({e.kind} at {e.where}: {verdict}, {e.magnitude:.3g}x bound)"
            )
        continue
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
print(f"{len(events.read())} event(s) in {events.path}")
