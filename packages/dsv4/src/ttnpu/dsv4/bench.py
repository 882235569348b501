"""Forward+backward tokens/s of this DeepSeek-V4 vs transformers' DeepseekV4 on the same config and
weights, measured side by side (interleaved repetitions) in one run; prints one JSON line.

    python -m ttnpu.dsv4.bench [--flavors debug small] [--seq-len 256] [--batch 1] [--repeats 5]

Both sides compute the main-head next-token cross-entropy (transformers has no MTP); ours with
MTP, the balance and the indexer losses is reported as well. transformers is optional: without it
only our figures are printed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import save_pretrained
from .config import DeepSeekV4Config
from .model import DeepSeekV4

__all__ = ["main"]


def _step_time(step: Callable[[], torch.Tensor], module: nn.Module) -> float:
    start = time.perf_counter()
    step().backward()
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench_flavor(flavor: str, seq_len: int, batch: int, repeats: int) -> dict[str, object]:
    config = DeepSeekV4Config.from_flavor(flavor)
    torch.manual_seed(0)
    ours = DeepSeekV4(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
    labels = torch.roll(tokens, -1, 1)

    def ours_ce() -> torch.Tensor:
        return F.cross_entropy(ours(tokens).flatten(0, 1), labels.flatten())

    steps: dict[str, tuple[Callable[[], torch.Tensor], nn.Module]] = {
        "ours": (ours_ce, ours),
        "ours_full_loss": (lambda: ours.loss(tokens, labels), ours),
    }
    result: dict[str, object] = {"flavor": flavor, "seq_len": seq_len, "batch": batch}
    try:
        import transformers
    except ImportError:
        result["hf"] = "transformers not installed"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(ours, tmp)
            hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        hf.train()

        def hf_ce() -> torch.Tensor:
            logits = hf(tokens).logits
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

        steps["hf"] = (hf_ce, hf)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, (step, module) in steps.items():
            elapsed = _step_time(step, module)
            if repeat:
                times[name].append(elapsed)
    tokens_per_step = batch * seq_len
    for name, samples in times.items():
        result[f"{name}_tokens_per_s"] = round(tokens_per_step / min(samples), 1)
    if "hf" in times:
        result["speedup_vs_hf"] = round(min(times["hf"]) / min(times["ours"]), 2)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--flavors", nargs="+", default=["debug", "small"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [bench_flavor(f, args.seq_len, args.batch, args.repeats) for f in args.flavors]
    print(
        json.dumps({"bench": "ttnpu.dsv4", "threads": torch.get_num_threads(), "results": results})
    )


if __name__ == "__main__":
    main()
