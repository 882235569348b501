"""Forward + backward tokens/s and peak memory of this DeepSeek-V4, per attention backend, eager
and compiled, against transformers' DeepseekV4 (eager attention) on the same config and weights,
measured side by side (interleaved repetitions) in one run; prints one JSON line.

    python -m ttnpu.dsv4.bench [--flavors debug] [--seq-len 256 2048] [--batch 1] [--repeats 3]
        [--backends reference chunked] [--compile-backend inductor|aot_eager|eager|none]
        [--device cpu] [--threads N] [--no-hf]

Every variant computes the main-head next-token cross-entropy (transformers has no MTP) and its
backward; ``chunked+full_loss`` is ours with MTP, the balance and the indexer losses
(``model.loss``). The attention backends are those this device runs (``reference`` and
``chunked`` everywhere, ``flex`` on CUDA, ``npu`` on Ascend). ``+compile`` is every block under
``torch.compile`` (the routed-expert dispatch stays eager, as ``ttnpu.dsv4.ac_compile`` does); a
variant that fails reports its error instead of figures. Per variant: ``tokens_per_s`` (best
round; the first round warms up and compiles), ``step_s`` (its median) and ``peak_mib``: the peak
of live tensor bytes over one more forward + backward, above what was live before it (on CPU the
running sum of the profiler's allocation and free events, on an accelerator its allocator's peak
statistics), the same method for every variant. transformers is optional: without it only our
figures are printed.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import save_pretrained
from .config import DeepSeekV4Config
from .model import DeepSeekV4
from .moe import MoE

__all__ = ["available_backends", "bench_case", "main", "peak_bytes"]

MIB = 2**20
Step = Callable[[], torch.Tensor]


def available_backends(device: torch.device) -> list[str]:
    """The attention backends ``device`` runs."""
    extra = {"cuda": ["flex"], "npu": ["npu"]}.get(device.type, [])
    return ["reference", "chunked", *extra]


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _run(step: Step, module: nn.Module, device: torch.device) -> float:
    """Seconds of one forward + backward (gradients cleared before, outside the timing)."""
    module.zero_grad(set_to_none=True)
    _sync(device)
    start = time.perf_counter()
    step().backward()
    _sync(device)
    return time.perf_counter() - start


def peak_bytes(step: Step, module: nn.Module, device: torch.device) -> int:
    """Peak of live tensor bytes over one forward + backward of ``step``, above what was live
    before it (gradients cleared first, so they count)."""
    module.zero_grad(set_to_none=True)
    if device.type == "cpu":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step().backward()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        return peak
    memory = getattr(torch, device.type)  # torch.cuda, torch.npu (torch_npu), ...
    _sync(device)
    before = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    step().backward()
    _sync(device)
    return int(memory.max_memory_allocated() - before)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def _compile_blocks(model: DeepSeekV4, backend: str) -> None:
    """``torch.compile`` every main block; the routed-expert dispatch stays eager (its shapes
    depend on the routing, and torch 2.14 has no fp32 fake kernel of ``_grouped_mm``)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.dispatch = torch.compiler.disable(module.dispatch)
    for block in model.layers:
        block.compile(backend=backend)


def _transformers(ours: DeepSeekV4, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    """transformers' DeepseekV4ForCausalLM with ours's weights (through the official layout)."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager"
        )
    model = cast(nn.Module, hf).to(device).train()
    info = {
        "version": transformers.__version__,
        "attn_implementation": hf.config._attn_implementation,
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
    }
    return model, info


def bench_case(
    flavor: str,
    seq_len: int,
    *,
    batch: int = 1,
    repeats: int = 3,
    backends: list[str] | None = None,
    compile_backend: str = "inductor",
    device: torch.device | None = None,
    hf: bool = True,
) -> dict[str, object]:
    """One flavor at one sequence length: every variant's figures and their ratios to
    transformers'."""
    device = device or torch.device("cpu")
    backends = backends or available_backends(device)
    config = DeepSeekV4Config.from_flavor(flavor)
    torch.manual_seed(0)
    base = DeepSeekV4(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
    labels = torch.roll(tokens, -1, 1)
    result: dict[str, Any] = {"flavor": flavor, "seq_len": seq_len, "batch": batch}
    variants: dict[str, dict[str, Any]] = {}
    steps: dict[str, tuple[Step, nn.Module]] = {}

    def ce(model: Callable[[torch.Tensor], torch.Tensor]) -> Step:
        return lambda: F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())

    def full_loss(model: DeepSeekV4) -> Step:
        return lambda: model.loss(tokens, labels)

    def logits_of(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: cast(torch.Tensor, model(t).logits)

    if hf:
        try:
            model, result["transformers"] = _transformers(base, device)
        except Exception as exc:  # not installed, or it cannot load this flavor
            variants["transformers"] = {"error": _error(exc)}
        else:
            steps["transformers"] = (ce(logits_of(model)), model)
    for backend in backends:
        ours = DeepSeekV4(config.replace(attention_backend=backend)).to(device)
        ours.load_state_dict(base.state_dict())
        steps[backend] = (ce(ours), ours)
        if backend == "chunked":
            steps["chunked+full_loss"] = (full_loss(ours), ours)
        if compile_backend != "none":
            compiled = copy.deepcopy(ours)
            try:
                _compile_blocks(compiled, compile_backend)
            except Exception as exc:  # e.g. an unknown backend
                variants[f"{backend}+compile"] = {"error": _error(exc)}
            else:
                steps[f"{backend}+compile"] = (ce(compiled), compiled)
    del base
    times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(repeats + 1):  # the first round warms up (and compiles)
        for name, (step, module) in list(steps.items()):
            try:
                elapsed = _run(step, module, device)
            except Exception as exc:  # a compile failure, or no kernel for this device
                variants[name] = {"error": _error(exc)}
                del steps[name]
                continue
            if repeat:
                times[name].append(elapsed)
    for name, (step, module) in steps.items():
        variants[name] = {
            "tokens_per_s": round(batch * seq_len / min(times[name]), 1),
            "step_s": round(statistics.median(times[name]), 4),
            "peak_mib": round(peak_bytes(step, module, device) / MIB, 1),
        }
        module.zero_grad(set_to_none=True)
    result["variants"] = variants
    reference = variants.get("transformers", {})
    if "tokens_per_s" in reference:
        ours_names = [n for n, v in variants.items() if n != "transformers" and "tokens_per_s" in v]
        result["speedup_vs_transformers"] = {
            n: round(variants[n]["tokens_per_s"] / reference["tokens_per_s"], 2) for n in ours_names
        }
        result["peak_memory_vs_transformers"] = {
            n: round(variants[n]["peak_mib"] / reference["peak_mib"], 3) for n in ours_names
        }
    return result


def _default_device() -> str:
    if not torch.accelerator.is_available():
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ttnpu.dsv4.bench",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--flavors", nargs="+", default=["debug"])
    parser.add_argument("--seq-len", nargs="+", type=int, default=[256, 2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument(
        "--backends", nargs="+", default=None, help="default: those the device runs"
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the '+compile' variants; 'none' skips them",
    )
    parser.add_argument("--device", default=None, help="default: the accelerator, else cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or _default_device())
    backends = args.backends or available_backends(device)
    unknown = sorted(set(backends) - set(available_backends(device)))
    if unknown:
        parser.error(f"--backends {unknown} do not run on {device.type}")
    if args.compile_backend != "none":
        import torch._dynamo as dynamo

        # One graph per block type, backend and sequence length: more than dynamo's default
        # cache of 8 per code object.
        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    results = [
        bench_case(
            flavor,
            seq_len,
            batch=args.batch,
            repeats=args.repeats,
            backends=backends,
            compile_backend=args.compile_backend,
            device=device,
            hf=not args.no_hf,
        )
        for flavor in args.flavors
        for seq_len in args.seq_len
    ]
    print(
        json.dumps(
            {
                "bench": "ttnpu.dsv4",
                "device": device.type,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "compile_backend": args.compile_backend,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
