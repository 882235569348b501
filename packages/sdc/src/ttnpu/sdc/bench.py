"""Step-time overhead of each detector on a small transformer-style model, side by side.

``python -m ttnpu.sdc.bench`` prints one JSON line. One bf16 model (attention, MLP and a top-1
MoE layer whose experts run as ``torch._grouped_mm``; ``--dtype float32`` drops the MoE layer, as
grouped mm takes bf16 only) is trained with SGD in every variant, interleaved step by step; the
compiled pass checks the model's dtype. An eager variant's checks are entered around the
forward and backward of a step, not its optimizer update, as ttnpu-trainer enters them. Steps are
timed in process CPU time (all threads of this process, gloo's included), which other processes
on a shared machine do not inflate, and each variant keeps its fastest round (interference only
adds time). Each figure is that time divided by the one of its baseline (eager, or compiled
without the pass):

* ``eager_checksums``: :class:`ChecksumMode` over every matmul, forward and backward, timed
  once its screens are compiled (the warm-up compiles them: :func:`compile_screens`);
* ``eager_checksums_on_exit``: the same, its verdicts read once per step
  (``verdicts="on_exit"``: one host sync per step instead of one per product, which a CPU does
  not feel and an accelerator's queue does);
* ``eager_checksums_all_ops``: the same checks seen through a dispatch mode over every aten op
  (``intercept="all_ops"``) instead of the dispatcher key that only the covered matmuls take;
* ``eager_checks_off``: the eager checks' window with its switch off, so every covered matmul
  still passes through it but none is screened: the interception's own cost (the key in the
  thread's dispatch keys, the matmuls' Python kernel), the floor under ``eager_checksums`` for
  any check made after the op;
* ``compiled_checksums``: the Inductor pass with checks on; ``compiled_checks_off`` with the
  pass compiled in but switched off (the fused screen still runs, the verdict is not read);
  ``compiled_checksums_per_graph``: the pass with ``verdicts="graph"``, one verdict call per
  graph instead of one per product;
* ``gradient_detection``: :class:`GradientDetector` at every step (sampling interval 3);
* ``comm_checks``: the gradients, views of one flat bucket as under DDP's
  ``gradient_as_bucket_view``, all-reduced through :class:`CollectiveChecker` instead of plain
  ``all_reduce`` on a one-rank gloo group (checksum work and the extra small collective);
* ``escalation``: the trainer's default policy (``checksums = "escalate"``) on a clean run:
  gradient detection and the switch's step sampling at every step, measured, plus the sampled
  fraction of steps (``--sample-steps``) at the measured extra cost of a checked eager step.
  ``coverage`` is the fraction of steps whose matmuls each mode checks: the recall of a flip that
  leaves gradient statistics alone (a checked step catches every must-catch flip, see the
  campaign), and 1/coverage the steps a persistent fault stays unseen.

glibc hands freed blocks above its mmap threshold back to the system, so on CPU every large
temporary (the checks' fp32 copies, the step's own activations) page-faults anew each step, which
a device's caching allocator never does; ``--allocator caching`` (the default) raises the
thresholds for every variant alike, ``system`` leaves glibc as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import ctypes.util
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import CollectiveChecker
from .compiled import checksum_compile_options, compiled_stats
from .config import SDCConfig
from .eager import ChecksumMode
from .events import Reporter, VetoFlag, set_default_reporter
from .gradient import GradientDetector
from .sites import compile_screens
from .switch import BACKGROUND_SAMPLE_STEPS, ChecksumSwitch, checksum_switch

__all__ = ["main"]


class _MoE(nn.Module):
    """Top-1 routed experts run as one grouped matmul per projection."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, 2 * dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, 2 * dim, dim) / (2 * dim) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        probs = torch.softmax(self.router(flat).float(), -1)
        gate, expert = probs.max(-1)
        order = expert.argsort()
        counts = nn.functional.one_hot(expert, self.up.shape[0]).sum(0)
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(flat[order], self.up, offs=offs)
        out = torch._grouped_mm(nn.functional.gelu(h), self.down, offs=offs)
        out = torch.empty_like(out).index_copy(0, order, out) * gate.to(out.dtype).unsqueeze(-1)
        return out.view_as(x)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.moe = _MoE(dim, experts) if experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        attn = (torch.softmax(scores.float(), -1).to(x.dtype) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        x = x + self.mlp(x)
        return x if self.moe is None else x + self.moe(x)


def _model(dim: int, layers: int, vocab: int, dtype: torch.dtype) -> nn.Module:
    # torch._grouped_mm takes bf16 (and fp16 on some devices) only: MoE layers in bf16 models.
    experts = 4 if dtype == torch.bfloat16 else 0
    blocks = [_Block(dim, 4, experts) for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, dim), *blocks, nn.Linear(dim, vocab)).to(dtype)


Context = Callable[[], contextlib.AbstractContextManager[Any]]
Step = Callable[[Context], None]


def _stepper(
    model: nn.Module,
    fn: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    after_backward: Callable[[], None] | None = None,
) -> Step:
    """One training step whose forward and backward run inside ``context()``, as the trainer
    enters its checks (the optimizer's update has no matmul to check)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(context: Context) -> None:
        with context():
            logits = fn(tokens[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
            )
            loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def _gradient_bucket(model: nn.Module) -> Callable[[], torch.Tensor]:
    """Every gradient as a view of one flat buffer, so a step all-reduces one bucket (DDP's
    ``gradient_as_bucket_view``); the backward accumulates into the views in place and
    ``zero_grad(set_to_none=False)`` keeps them. Returns the buffer, refusing a gradient that
    left it."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    addresses: list[int | None] = []
    offset = 0
    for p in params:
        grad = flat[offset : offset + p.numel()].view_as(p)
        p.grad = grad
        addresses.append(grad.data_ptr())
        offset += p.numel()

    def bucket() -> torch.Tensor:
        if [None if p.grad is None else p.grad.data_ptr() for p in params] != addresses:
            raise RuntimeError("bench: a gradient is no longer a view of its bucket")
        return flat

    return bucket


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _time(step: Step, steps: int, context: Context) -> float:
    start = time.process_time()
    for _ in range(steps):
        step(context)
    return (time.process_time() - start) / steps


def _caching_malloc() -> bool:
    """Keep freed memory in the process (glibc ``mallopt``), as device caching allocators do."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all(
        mallopt(option, value)
        for option, value in (
            (m_mmap_threshold, 32 << 20),
            (m_trim_threshold, 1 << 30),
            (m_top_pad, 256 << 20),
        )
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    base = _model(args.dim, args.layers, args.vocab, dtype)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1))
    flag = VetoFlag()
    reporter = Reporter([flag])
    none = contextlib.nullcontext

    def variant(
        after: Callable[[nn.Module], Callable[[], None] | None] | None = None,
        compiled: bool = False,
        options: dict[str, Any] | None = None,
    ) -> Step:
        model = copy.deepcopy(base)
        fn = torch.compile(model, options=options) if compiled else model
        return _stepper(model, fn, tokens, after(model) if after else None)

    def plain_allreduce(model: nn.Module) -> Callable[[], None]:
        bucket = _gradient_bucket(model)

        def reduce() -> None:
            dist.all_reduce(bucket())

        return reduce

    def checked_allreduce(model: nn.Module) -> Callable[[], None]:
        checker, bucket = CollectiveChecker(reporter=reporter), _gradient_bucket(model)

        def reduce() -> None:
            checker.all_reduce(bucket())

        return reduce

    policy = ChecksumSwitch(on=False, sample_steps=args.sample_steps)
    escalate_mode = ChecksumMode(reporter=reporter, switch=policy)
    steps_run = [0]

    def gradient(model: nn.Module, switch: ChecksumSwitch | None = None) -> Callable[[], None]:
        det = GradientDetector(
            model.named_parameters(), SDCConfig(), reporter=reporter, switch=switch
        )

        def detect() -> None:
            det.after_backward()

        return detect

    def escalation(model: nn.Module) -> Callable[[], None]:
        return gradient(model, policy)  # a strike escalates the policy's own switch

    def escalated() -> contextlib.AbstractContextManager[Any]:
        steps_run[0] += 1  # as the trainer's guard: enter the checks on a sampled step only
        return escalate_mode if policy.begin_step(steps_run[0]) else none()

    eager_mode = ChecksumMode(reporter=reporter)
    intercept_mode = ChecksumMode(reporter=reporter, switch=ChecksumSwitch(on=False))
    on_exit_mode = ChecksumMode(reporter=reporter, verdicts="on_exit")
    all_ops_mode = ChecksumMode(reporter=reporter, intercept="all_ops")
    set_default_reporter(reporter)  # the compiled checks report through the default reporter
    with _one_rank_group():
        pass_step = variant(compiled=True, options=checksum_compile_options(dtypes=(dtype,)))
        graph_options = checksum_compile_options(dtypes=(dtype,), verdicts="graph")
        variants: dict[str, tuple[Step, Context]] = {
            "eager": (variant(), none),
            "eager_checksums": (variant(), lambda: eager_mode),
            "eager_checks_off": (variant(), lambda: intercept_mode),
            "eager_checksums_on_exit": (variant(), lambda: on_exit_mode),
            "eager_checksums_all_ops": (variant(), lambda: all_ops_mode),
            "gradient_detection": (variant(gradient), none),
            "escalation": (variant(escalation), escalated),
            "allreduce": (variant(plain_allreduce), none),
            "allreduce_checked": (variant(checked_allreduce), none),
            "compiled": (variant(compiled=True), none),
            "compiled_checksums": (pass_step, none),
            "compiled_checks_off": (pass_step, none),
            "compiled_checksums_per_graph": (variant(compiled=True, options=graph_options), none),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for step, context in variants.values():  # warm-up and compilation
            step(context)
            step(context)
        compile_screens()
        for name in ("eager_checksums", "eager_checksums_on_exit", "eager_checksums_all_ops"):
            step, context = variants[name]
            step(context)
            step(context)
        counted = {"compiled_checksums": "compiled", "compiled_checksums_per_graph": "per_graph"}
        checked = dict.fromkeys(counted.values(), 0)
        eager_before = eager_mode.stats.checked, all_ops_mode.stats.checked
        for _ in range(args.rounds):
            for name, (step, context) in variants.items():
                if name == "compiled_checks_off":
                    checksum_switch.off()
                before = compiled_stats().checked
                times[name].append(_time(step, args.steps, context))
                checksum_switch.on()
                if name in counted:
                    checked[counted[name]] += compiled_stats().checked - before
        checked["eager"] = eager_mode.stats.checked - eager_before[0]
        checked["eager_all_ops"] = all_ops_mode.stats.checked - eager_before[1]
        steps = args.rounds * args.steps
        checks = {name: n / steps for name, n in checked.items()}
    med = {name: min(t) for name, t in times.items()}

    def ratio(name: str, baseline: str) -> float:
        return round(med[name] / med[baseline], 4)

    checked_extra = med["eager_checksums"] - med["eager"]
    escalation_cost = (med["escalation"] + args.sample_steps * checked_extra) / med["eager"]

    return {
        "bench": "ttnpu.sdc",
        "model": {
            "dim": args.dim,
            "layers": args.layers,
            "seq": args.seq,
            "batch": args.batch,
            "dtype": args.dtype,
            "experts": 4 if dtype == torch.bfloat16 else 0,
        },
        "step_cpu_ms": {name: round(1e3 * t, 2) for name, t in med.items()},
        "eager_checksums": ratio("eager_checksums", "eager"),
        "eager_checks_off": ratio("eager_checks_off", "eager"),
        "eager_checksums_on_exit": ratio("eager_checksums_on_exit", "eager"),
        "eager_checksums_all_ops": ratio("eager_checksums_all_ops", "eager"),
        "compiled_checksums": ratio("compiled_checksums", "compiled"),
        "compiled_checks_off": ratio("compiled_checks_off", "compiled"),
        "compiled_checksums_per_graph": ratio("compiled_checksums_per_graph", "compiled"),
        "gradient_detection": ratio("gradient_detection", "eager"),
        "comm_checks": ratio("allreduce_checked", "allreduce"),
        "escalation": round(escalation_cost, 4),
        "coverage": {
            "eager_checksums": 1.0,
            "eager_checksums_on_exit": 1.0,
            "eager_checksums_all_ops": 1.0,
            "compiled_checksums": 1.0,
            "compiled_checksums_per_graph": 1.0,
            "escalation": args.sample_steps,
            "gradient_detection": 0.0,
        },
        "goals": {
            "compiled_checksums": 1.10,
            "eager_checksums": 1.30,
            "comm_checks": 1.05,
            "escalation": 1.02,
        },
        "sample_steps": args.sample_steps,
        "allocator": args.allocator,
        "checks_per_step": checks,
        "events": len(flag.take()),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ttnpu.sdc.bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (the MoE layer needs bfloat16)",
    )
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--sample-steps",
        type=float,
        default=BACKGROUND_SAMPLE_STEPS,
        help="fraction of steps the escalation policy checks anyway (the trainer's default)",
    )
    p.add_argument(
        "--allocator",
        choices=["caching", "system"],
        default="caching",
        help="keep freed memory in the process (as a device allocator does) or not",
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.sample_steps <= 1.0:
        p.error(f"--sample-steps must be in [0, 1], got {args.sample_steps}")
    if args.allocator == "caching" and not _caching_malloc():
        p.error("--allocator caching needs glibc's mallopt; use --allocator system")
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
