"""Benchmark of ttnpu.ft; prints one JSON line.

    python -m ttnpu.ft.bench [--steps 30] [--width 1024] [--depth 4] [--batch 256] [--mb 256]

Side by side in one run, on this host:
- tokens/s with fault tolerance on (two torchft replica groups, embedded Lighthouse) vs off (the
  same two processes as plain gloo data parallelism), and FT's own per-step calls as a fraction of
  the step;
- the time from SIGKILL of one replica (mid-step) to the survivor's next commit;
- heal transfer throughput: ttnpu's SocketTransport vs torchft's HTTPTransport on the same
  snapshot, with a cold copy of the same bytes as the host's ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torchft.checkpointing.http_transport import HTTPTransport

from ttnpu.ft.lighthouse import EmbeddedLighthouse
from ttnpu.ft.transport import SocketTransport

HEARTBEAT_MS = 1000


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _launch(out: Path, replica_id: int, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ttnpu.ft.drill", "--replica-id", str(replica_id)]
    cmd += ["--out", str(out), "--go-file", str(out / "go"), "--no-save", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
    log = (out / f"stderr_{replica_id}.log").open("w")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.05)
    raise TimeoutError(f"bench: timed out waiting for {what}")


def run_arm(mode: str, args: argparse.Namespace, root: Path, kill: bool = False) -> dict[str, Any]:
    """Two replicas of ``mode`` ("ft" or "plain"); tokens/s over the steps after warm-up."""
    out = root / f"{mode}_{time.monotonic_ns()}"
    out.mkdir()
    model = ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    steps = args.steps + (1000 if kill else 0)
    lighthouse = None
    if mode == "ft":
        lighthouse = EmbeddedLighthouse(
            1, join_timeout_ms=30_000, heartbeat_timeout_ms=HEARTBEAT_MS
        )
        extra = ["--mode", "ft", "--lighthouse", lighthouse.address, "--steps", str(steps)]
    else:
        extra = ["--mode", "plain", "--master-port", str(_free_port()), "--steps", str(steps)]
    procs = [_launch(out, i, [*extra, *model]) for i in range(2)]
    logs = [out / f"replica_{i}.jsonl" for i in range(2)]
    try:
        _wait(
            lambda: all(any(r.get("event") == "ready" for r in _records(p)) for p in logs),
            300,
            "ready",
        )
        (out / "go").touch()
        steps_of = lambda i: [r for r in _records(logs[i]) if r.get("committed")]  # noqa: E731
        _wait(
            lambda: len(steps_of(0)) >= args.steps and len(steps_of(1)) >= args.steps, 900, "steps"
        )
        result = _throughput(args, [steps_of(0)[: args.steps], steps_of(1)[: args.steps]])
        if kill:
            result["death_to_next_commit_s"] = _kill_and_time(procs[1], logs[0])
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if lighthouse is not None:
            lighthouse.close()


def _throughput(
    args: argparse.Namespace, per_replica: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    warm = max(2, args.steps // 5)
    tokens_s = 0.0
    ft_fraction = []
    for records in per_replica:
        timed = records[warm:]
        span = timed[-1]["t"] - records[warm - 1]["t"]
        tokens_s += args.batch * len(timed) / span
        for r in timed:
            timings = r.get("timings", {})
            own = timings.get("quorum", 0.0) + timings.get("vote_commit", 0.0)
            ft_fraction.append(own / r["seconds"])
    step_s = statistics.median(r["seconds"] for r in per_replica[0][warm:])
    allreduce_s = statistics.median(r["timings"]["allreduce"] for r in per_replica[0][warm:])
    return {
        "tokens_per_s": tokens_s,
        "step_s": step_s,
        "allreduce_s": allreduce_s,
        "ft_own_calls_fraction": statistics.median(ft_fraction) if ft_fraction else 0.0,
    }


def _kill_and_time(victim: subprocess.Popen[bytes], survivor_log: Path) -> float:
    time.sleep(0.05)
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)

    def after() -> list[dict[str, Any]]:
        return [r for r in _records(survivor_log) if r.get("t", 0) > t_kill and r.get("committed")]

    first = _wait(after, 120, "the survivor's next commit")[0]
    return float(first["t"] - t_kill)


def transfer(megabytes: int) -> dict[str, float]:
    """One transfer of a ``megabytes`` snapshot per transport, and a cold copy of the same bytes."""
    n = megabytes * 2**20 // 4
    state = {"user": {"default": {f"w{i}": torch.randn(n // 8) for i in range(8)}}, "torchft": {}}
    nbytes = n // 8 * 8 * 4
    timeout = timedelta(seconds=120)
    rates: dict[str, float] = {}
    for name, make in (
        ("http", lambda: HTTPTransport[Any](timeout=timeout, num_chunks=0)),
        ("socket", lambda: SocketTransport[Any](timeout)),
    ):
        src, dst = make(), make()
        try:
            src.send_checkpoint([1], 1, state, timeout)
            t0 = time.perf_counter()
            dst.recv_checkpoint(0, src.metadata(), 1, timeout)
            rates[name] = nbytes / (time.perf_counter() - t0) / 1e9
        finally:
            src.disallow_checkpoint()
            src.shutdown()
            dst.shutdown()
    t0 = time.perf_counter()
    copies = [v.clone() for v in state["user"]["default"].values()]
    rates["cold_copy"] = nbytes / (time.perf_counter() - t0) / 1e9
    del copies
    return {
        "http_GBps": rates["http"],
        "socket_GBps": rates["socket"],
        "socket_vs_http": rates["socket"] / rates["http"],
        "cold_copy_GBps": rates["cold_copy"],
        "bytes": nbytes,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mb", type=int, default=256, help="snapshot size for the transfer figure")
    p.add_argument("--rounds", type=int, default=2, help="alternating off/on rounds (median)")
    args = p.parse_args(argv)
    offs, ons = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            offs.append(run_arm("plain", args, root))
            ons.append(run_arm("ft", args, root, kill=r == args.rounds - 1))
    transfers = [transfer(args.mb) for _ in range(args.rounds)]
    ratios = [on["tokens_per_s"] / off["tokens_per_s"] for off, on in zip(offs, ons, strict=True)]
    median = statistics.median

    def mid(arms: list[dict[str, Any]], key: str) -> float:
        return float(median(a[key] for a in arms))

    figures = {
        "bench": "ttnpu.ft",
        "host_cpus": os.cpu_count(),
        "model": {
            "width": args.width,
            "depth": args.depth,
            "batch": args.batch,
            "steps": args.steps,
        },
        "rounds": args.rounds,
        "tokens_per_s_ft_off": mid(offs, "tokens_per_s"),
        "tokens_per_s_ft_on": mid(ons, "tokens_per_s"),
        "ft_on_off_ratio": median(ratios),
        "ft_on_off_ratios": ratios,
        "step_s_ft_off": mid(offs, "step_s"),
        "step_s_ft_on": mid(ons, "step_s"),
        "grad_allreduce_s_ft_off": mid(offs, "allreduce_s"),
        "grad_allreduce_s_ft_on": mid(ons, "allreduce_s"),
        "ft_own_calls_fraction_of_step": mid(ons, "ft_own_calls_fraction"),
        "death_to_next_commit_s": ons[-1]["death_to_next_commit_s"],
        "heartbeat_timeout_s": HEARTBEAT_MS / 1000,
        "transfer": {k: median(t[k] for t in transfers) for k in transfers[0]},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
