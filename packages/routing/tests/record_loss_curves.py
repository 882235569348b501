"""Record the real loss curves the detector tests replay: ``python record_loss_curves.py``.

Each curve is the per-step loss of TinyMoE trained with AdamW on the Markov corpus (seeds 0..9),
no spikes injected. Recorded once so the unit tests stay fast; ``test_detector`` retrains the
first steps of one curve to show the record matches the code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ttnpu.routing.testing import MarkovCorpus, TinyMoE

STEPS = 400
SEEDS = range(10)
PATH = Path(__file__).parent / "data" / "real_loss_curves.json"


def train_curve(seed: int, steps: int) -> list[float]:
    torch.manual_seed(seed)
    model = TinyMoE()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _, batch in zip(range(steps), MarkovCorpus(seed=seed, batch=4), strict=False):
        loss = model.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_router_biases()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    torch.set_num_threads(1)
    curves = {str(seed): train_curve(seed, STEPS) for seed in SEEDS}
    PATH.write_text(json.dumps(curves) + "\n")
    print(f"wrote {len(curves)} curves of {STEPS} steps to {PATH}")
