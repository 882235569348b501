"""The compiled screen after a GEMM against a checksum computed inside it, side by side.

``python -m ttnpu.sdc.bench_in_gemm`` prints one JSON line. For each linear product of the
bench's model (``x @ w.t()``, bf16, tokens x dim), three compiled functions are timed:

* ``plain``: the product alone;
* ``screen``: the product and the screen the compiled pass inlines after it
  (:func:`~ttnpu.sdc.checksum.matmul_screen`, ``fused=True``: one pass over x, w and the
  product, the expected row sums x·(wᵀ1) in fp32);
* ``in_gemm`` and ``in_gemm_padded``: the operand augmented with its column sums, so one GEMM
  yields the product and its check column (``w`` with the row 1ᵀw appended; padded to 16 rows
  more, which keeps the GEMM's blocking), and the row sums of the product compared with that
  column. The bound still needs each row's norm of x, a pass over x, and the check column and
  the appended row are rounded to bf16 like the product, which loosens the bound by bf16's
  rounding of each row's magnitude: a weaker check than the screen's fp32 one.

Each figure is a function's time over ``plain``'s (CPU time, fastest of ``--rounds``
interleaved rounds of ``--calls`` calls). ``caught`` says that each checking variant passes the
clean product and flags one whose element had its top exponent bit flipped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .checksum import SIGMAS, matmul_screen, unit_roundoff
from .inject import flip_bit

__all__ = ["main"]

_U, _U32 = unit_roundoff(torch.bfloat16), unit_roundoff(torch.float32)


class _Check:
    """A checked product in two parts: ``product(x, w)`` -> (out, what the check keeps), and
    ``judge(x, w, out, kept)`` -> the worst row's error over its bound (passes at <= 1)."""

    def __init__(
        self,
        product: Callable[[Tensor, Tensor], tuple[Tensor, Any]],
        judge: Callable[[Tensor, Tensor, Tensor, Any], Tensor],
    ) -> None:
        self.product, self.judge = product, judge

    def __call__(self, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        out, kept = self.product(x, w)
        return out, self.judge(x, w, out, kept)

    def caught(self, x: Tensor, w: Tensor) -> bool:
        """Passes the clean product, flags it with one element's top exponent bit flipped."""
        out, kept = self.product(x, w)
        flipped = out.clone()
        flip_bit(flipped, flipped.numel() // 2 + 3, 14)
        return float(self.judge(x, w, out, kept)) <= 1.0 < float(self.judge(x, w, flipped, kept))


def _plain(x: Tensor, w: Tensor) -> Tensor:
    return x @ w.t()


def _screen(x: Tensor, w: Tensor, out: Tensor, kept: None) -> Tensor:
    return matmul_screen(x, w.t(), out, None, 1.0, 1.0, SIGMAS, True)


def _augmented(pad: int) -> Callable[[Tensor, Tensor], tuple[Tensor, Any]]:
    def product(x: Tensor, w: Tensor) -> tuple[Tensor, Any]:
        n, k = w.shape
        sums = w.float().sum(0, keepdim=True).to(w.dtype)  # the check column's weights
        full = x @ torch.cat([w, sums, w.new_zeros(pad - 1, k)]).t()
        return full[:, :n], (sums[0], full[:, n])

    return product


def _column(x: Tensor, w: Tensor, out: Tensor, kept: tuple[Tensor, Tensor]) -> Tensor:
    """|Σ_j c_ij - column_i| over fp32 accumulation noise (as the screen models it) plus bf16
    rounding of the product, the check column and the appended row; inf where a row is not
    finite (a flip to inf or NaN)."""
    sums, column = (t.float() for t in kept)
    xf, c = x.float(), out.float()
    noise = SIGMAS * _U32 * math.sqrt(w.shape[1]) * xf.norm(dim=-1) * w.float().norm()
    rounding = _U * (c.abs().sum(-1) + column.abs() + xf.abs() @ sums.abs())
    ratio = (c.sum(-1) - column).abs() / (noise + rounding)
    return torch.where(torch.isfinite(ratio), ratio, math.inf).amax()


CHECKS = {
    "screen": _Check(lambda x, w: (x @ w.t(), None), _screen),
    "in_gemm": _Check(_augmented(1), _column),
    "in_gemm_padded": _Check(_augmented(16), _column),
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    d, t = args.dim, args.tokens
    shapes = {"qkv": (d, 3 * d), "mlp_up": (d, 4 * d), "mlp_down": (4 * d, d), "proj": (d, d)}
    figures: dict[str, Any] = {}
    caught: dict[str, bool] = {}
    with torch.no_grad():
        for name, (k, n) in shapes.items():
            x = torch.randn(t, k, dtype=torch.bfloat16)
            w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
            torch._dynamo.reset()  # the checks share one __call__: its cache is per shape
            variants: dict[str, Callable[..., Any]] = {"plain": _plain, **CHECKS}
            fns = {v: torch.compile(f, fullgraph=True) for v, f in variants.items()}
            for fn in fns.values():  # compile and warm up
                fn(x, w)
            best = dict.fromkeys(fns, math.inf)
            for _ in range(args.rounds):
                for v, fn in fns.items():
                    start = time.process_time()
                    for _ in range(args.calls):
                        fn(x, w)
                    best[v] = min(best[v], (time.process_time() - start) / args.calls)
            figures[name] = {v: round(best[v] / best["plain"], 3) for v in fns if v != "plain"}
            figures[name]["plain_us"] = round(best["plain"] * 1e6, 1)
            caught.update({f"{name}:{v}": check.caught(x, w) for v, check in CHECKS.items()})
    return {
        "bench": "ttnpu.sdc.bench_in_gemm",
        "tokens": t,
        "dim": d,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "calls": args.calls,
        "time_over_plain": figures,
        "caught": all(caught.values()),
        "missed": sorted(k for k, ok in caught.items() if not ok),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ttnpu.sdc.bench_in_gemm", description=__doc__.split("\n")[0]
    )
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    for name in ("tokens", "dim", "rounds", "calls", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
