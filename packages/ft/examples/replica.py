"""One torchft replica group training a small linear model; more groups join through its Lighthouse.

uv run python packages/ft/examples/replica.py --steps 100000   # prints its Lighthouse's address
uv run python packages/ft/examples/replica.py --replica-id 1 --lighthouse http://HOST:PORT
"""

import argparse
import functools

import torch

from ttnpu.ft import EmbeddedLighthouse, Replica, ReplicaConfig

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--replica-id", type=int, default=0)
parser.add_argument("--lighthouse", help="a running Lighthouse's address (default: start one)")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

lighthouse = None if args.lighthouse else EmbeddedLighthouse(min_replicas=1)
address = args.lighthouse or lighthouse.address  # or a torchft_lighthouse service's
print(f"Lighthouse at {address}", flush=True)

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)


def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


config = ReplicaConfig(replica_id=args.replica_id, lighthouse=address)
with Replica(config, model, opt) as replica:
    for _ in range(args.steps):
        x = torch.randn(8, 16)
        y = x.sum(dim=1, keepdim=True)
        if not torch.isfinite(x).all():
            replica.veto.raise_flag("non-finite input")  # every replica skips this step
        result = replica.run_step(functools.partial(forward_backward, x, y), average_output=True)
        state = "committed" if result.committed else "discarded"
        print(
            f"step {result.step}: {state} by {result.participants} replica group(s), "
            f"loss {float(result.output):.3f}",
            flush=True,
        )
if lighthouse is not None:
    lighthouse.close()
