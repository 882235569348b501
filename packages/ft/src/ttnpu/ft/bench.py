"""Benchmark of ttnpu.ft; prints one JSON line.

    python -m ttnpu.ft.bench [--rounds 5] [--steps 20] [--width 1024] [--depth 4] [--batch 256]

Side by side in one run, on this host:
- tokens/s of two data-parallel ranks in three arms interleaved in the same two processes
  (:mod:`ttnpu.ft.bench_arms`): off (plain gloo), ft (two ttnpu.ft replica groups) and torchft's
  own DDP + OptimizerWrapper; per round the on/off ratios, then their median and spread (min,
  max), CPU seconds per step beside wall seconds, and FT's own per-step calls (quorum wait,
  vote, commit) as a fraction of the step, beside torchft's own calls in its arm (quorum start
  and wait, ``should_commit``);
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

from ttnpu.ft.bench_arms import ARMS
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


def _launch_arms(out: Path, replica_id: int, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ttnpu.ft.bench_arms", "--replica-id", str(replica_id)]
    cmd += ["--out", str(out), "--go-file", str(out / "go"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
    log = (out / f"arms_stderr_{replica_id}.log").open("w")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)


def run_arms(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """The three arms interleaved in the same two processes; every step record of both."""
    out = root / "arms"
    out.mkdir()
    ours = EmbeddedLighthouse(2, join_timeout_ms=30_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    theirs = EmbeddedLighthouse(2, join_timeout_ms=30_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    extra = [
        "--master-port", str(_free_port()), "--lighthouse", ours.address,
        "--torchft-lighthouse", theirs.address, "--rounds", str(args.rounds),
        "--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth),
        "--batch", str(args.batch), "--bucket-cap-mb", str(args.bucket_cap_mb),
    ]  # fmt: skip
    procs = [_launch_arms(out, i, extra) for i in range(2)]
    logs = [out / f"arms_{i}.jsonl" for i in range(2)]
    try:
        _wait(lambda: all(_records(p) for p in logs), 300, "both bench ranks ready")
        (out / "go").touch()
        done = lambda i: any(r.get("event") == "done" for r in _records(logs[i]))  # noqa: E731
        over = lambda: all(done(i) or procs[i].poll() is not None for i in (0, 1))  # noqa: E731
        _wait(over, 3600, "the arms")
        for i in (0, 1):
            if not done(i):
                tail = (out / f"arms_stderr_{i}.log").read_text()[-2000:]
                raise RuntimeError(f"bench: rank {i} exited {procs[i].returncode}:\n{tail}")
        return [r for p in logs for r in _records(p) if "arm" in r]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        ours.close()
        theirs.close()


def _arm_round(records: list[dict[str, Any]]) -> dict[str, float]:
    """One arm in one round: median wall and CPU seconds per step (both ranks' steps) and FT's
    own calls as a fraction of the step."""
    own = [
        sum(r["timings"][k] for k in ("quorum", "vote", "commit")) / r["seconds"]
        for r in records
        if "timings" in r
    ]
    parts = {
        f"{key}_s": statistics.median(r["timings"][key] for r in records)
        for key in (records[0].get("timings") or {})
    }
    return {
        "step_s": statistics.median(r["seconds"] for r in records),
        "cpu_s": statistics.median(r["cpu_s"] for r in records),
        "own_fraction": statistics.median(own) if own else 0.0,
        **parts,
    }


def death_to_next_commit(args: argparse.Namespace, root: Path) -> float:
    """Two ft replicas (the drill); SIGKILL one mid-step; seconds to the survivor's next commit."""
    out = root / "kill"
    out.mkdir()
    lighthouse = EmbeddedLighthouse(1, join_timeout_ms=30_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    model = ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    extra = ["--mode", "ft", "--lighthouse", lighthouse.address, "--steps", "100000", *model]
    procs = [_launch(out, i, extra) for i in range(2)]
    logs = [out / f"replica_{i}.jsonl" for i in range(2)]
    try:
        _wait(
            lambda: all(any(r.get("event") == "ready" for r in _records(p)) for p in logs),
            300,
            "ready",
        )
        (out / "go").touch()
        committed = lambda i: [r for r in _records(logs[i]) if r.get("committed")]  # noqa: E731
        _wait(lambda: len(committed(0)) >= 3 and len(committed(1)) >= 3, 300, "steps")
        return _kill_and_time(procs[1], logs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        lighthouse.close()


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


def _ratios(args: argparse.Namespace, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round, each arm's throughput relative to off (the ratio of median step times, both
    ranks stepping together), wall and CPU; then the median over rounds and the spread."""
    rounds = [
        {
            arm: _arm_round([r for r in records if r["round"] == round_ and r["arm"] == arm])
            for arm in ARMS
        }
        for round_ in range(args.rounds)
    ]
    median = statistics.median
    figures: dict[str, Any] = {}

    def summarize(name: str, values: list[float]) -> None:
        figures[name] = median(values)
        figures[f"{name}_spread"] = [min(values), max(values)]

    for name, arm in (("ft", "ft"), ("torchft_ddp", "torchft")):
        ratios = [r["off"]["step_s"] / r[arm]["step_s"] for r in rounds]
        summarize(f"{name}_on_off_ratio", ratios)
        figures[f"{name}_on_off_ratios"] = [round(x, 4) for x in ratios]
        summarize(f"{name}_on_off_cpu_ratio", [r["off"]["cpu_s"] / r[arm]["cpu_s"] for r in rounds])
    for arm in ARMS:
        step_s = median(r[arm]["step_s"] for r in rounds)
        figures[f"tokens_per_s_{arm}"] = 2 * args.batch / step_s
        figures[f"step_s_{arm}"] = step_s
        figures[f"cpu_s_per_step_{arm}"] = median(r[arm]["cpu_s"] for r in rounds)
    figures["ft_own_calls_fraction_of_step"] = median(r["ft"]["own_fraction"] for r in rounds)
    # the same calls of torchft's own integration (its quorum start and wait, should_commit)
    figures["torchft_ddp_own_calls_fraction_of_step"] = median(
        r["torchft"]["own_fraction"] for r in rounds
    )
    figures["ft_step_parts_s"] = {  # quorum start+wait, waits after the backward, vote, commit
        key: median(r["ft"][key] for r in rounds)
        for key in ("quorum_s", "allreduce_s", "vote_s", "commit_s")
    }
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps per arm per round")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mb", type=int, default=256, help="snapshot size for the transfer figure")
    p.add_argument("--rounds", type=int, default=5, help="interleaved off/ft/torchft rounds")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0, help="ft arm's bucket size")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        records = run_arms(args, root)
        death_s = death_to_next_commit(args, root)
    transfers = [transfer(args.mb) for _ in range(3)]
    figures = {
        "bench": "ttnpu.ft",
        "host_cpus": os.cpu_count(),
        "host_load_1min": os.getloadavg()[0],
        "model": {
            "width": args.width,
            "depth": args.depth,
            "batch": args.batch,
            "steps_per_block": args.steps,
            "bucket_cap_mb": args.bucket_cap_mb,
        },
        "rounds": args.rounds,
        **_ratios(args, records),
        "death_to_next_commit_s": death_s,
        "heartbeat_timeout_s": HEARTBEAT_MS / 1000,
        "transfer": {k: statistics.median(t[k] for t in transfers) for k in transfers[0]},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
