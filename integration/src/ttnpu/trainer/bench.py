"""``python -m ttnpu.trainer.bench``: what the trainer costs on top of the model, as ratios.

One process, dsv4_debug on the bundled corpus, measured side by side (alternating rounds):

- ``trainer_over_bare_step``: a ``DSV4Trainer.commit_step`` with the default features (routing
  schedule, SDC gradient statistics with checksums on escalation, the local stepper, grad
  clipping, optimizer, LR schedule, expert-bias update) over a bare loop on the same model and
  batches (``loss.backward()``, ``AdamW.step()``).
- ``sdc_off_over_bare_step``, ``checksums_always_over_bare_step``: the same trainer step with SDC
  detection off, and with every matmul checksummed.
- ``checksum_over_save``: writing the SHA-256 manifest of a checkpoint over the DCP save itself.

Prints one JSON line. ``--rounds`` and ``--steps`` (default 3 and 3) set how many alternating
rounds, and trainer steps per round, are timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ttnpu.routing import AnticipatorySchedule

from .cli import single_process_env
from .config_registry import dsv4_debug
from .run_folder import write_checksums
from .sdc_guard import SDCGuard
from .trainer import DSV4Trainer

Batches = Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
Schedule = AnticipatorySchedule[tuple[dict[str, torch.Tensor], torch.Tensor]]


def _build(folder: str) -> DSV4Trainer:
    single_process_env()
    config = dsv4_debug()
    config.device, config.dump_folder = "cpu", folder
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    config.training.steps = 10_000
    trainer = config.build()
    assert isinstance(trainer, DSV4Trainer)
    return trainer


def _timed_trainer_steps(
    trainer: DSV4Trainer, schedule: Schedule, sdc: SDCGuard | None, steps: int
) -> float:
    trainer.sdc = sdc
    start = time.perf_counter()
    for _ in range(steps):
        trainer.commit_step(schedule)
    return (time.perf_counter() - start) / steps


def _timed_bare_steps(
    trainer: DSV4Trainer, batches: Batches, optimizer: torch.optim.Optimizer, steps: int
) -> float:
    model = trainer.model_parts[0]
    start = time.perf_counter()
    for _ in range(steps):
        inputs, labels = next(batches)
        optimizer.zero_grad()
        model(inputs["input"], labels=labels).backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def _ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the per-round ratios (rounds alternate, so drift cancels)."""
    return round(statistics.median(n / d for n, d in zip(numerators, denominators, strict=True)), 3)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ttnpu.trainer.bench",
        description="What the trainer costs on top of the model (dsv4_debug on CPU), as ratios "
        "measured side by side; prints one JSON line.",
    )
    parser.add_argument("--rounds", type=_positive, default=3, help="timed rounds (default 3)")
    parser.add_argument("--steps", type=_positive, default=3, help="steps per round (default 3)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    rounds, steps = args.rounds, args.steps
    with tempfile.TemporaryDirectory() as folder:
        trainer = _build(folder)
        try:
            schedule = trainer.spikes.schedule(trainer.dataloader, trainer.step)
            batches = schedule.data
            bare_optimizer = torch.optim.AdamW(trainer.model_parts[0].parameters(), lr=0.0)
            default = trainer.sdc
            assert default is not None
            always = SDCGuard(
                replace(trainer.config.sdc, checksums="always"),
                trainer.model_parts[0],
                replica_id=0,
                events_path=Path(folder) / "sdc_events.jsonl",
            )
            variants: dict[str, SDCGuard | None] = {
                "trainer": default,
                "sdc_off": None,
                "checksums_always": always,
            }
            for guard in variants.values():  # warm-up
                _timed_trainer_steps(trainer, schedule, guard, steps)
            _timed_bare_steps(trainer, batches, bare_optimizer, steps)
            times: dict[str, list[float]] = {name: [] for name in [*variants, "bare"]}
            for _ in range(rounds):
                for name, guard in variants.items():
                    times[name].append(_timed_trainer_steps(trainer, schedule, guard, steps))
                times["bare"].append(_timed_bare_steps(trainer, batches, bare_optimizer, steps))

            state = {
                "model": trainer.model_parts[0].state_dict(),
                "optimizer": trainer.optimizers.state_dict(),
            }
            save_s, checksum_s = [], []
            for i in range(rounds):
                path = Path(folder) / f"step-{i}"
                start = time.perf_counter()
                dcp.save(state, checkpoint_id=str(path))
                save_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                write_checksums(path)
                checksum_s.append(time.perf_counter() - start)
            checkpoint_mb = sum(p.stat().st_size for p in path.iterdir()) / 2**20
        finally:
            trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()

    print(
        json.dumps(
            {
                "bench": "ttnpu.trainer",
                "model": "dsv4_debug",
                "tokens_per_step": trainer.config.training.local_batch_size
                * trainer.config.training.seq_len,
                "trainer_step_s": round(statistics.median(times["trainer"]), 3),
                "bare_step_s": round(statistics.median(times["bare"]), 3),
                **{
                    f"{name}_over_bare_step": _ratio(times[name], times["bare"])
                    for name in ("trainer", "sdc_off", "checksums_always")
                },
                "checkpoint_mb": round(checkpoint_mb, 1),
                "save_s": round(statistics.median(save_s), 3),
                "checksum_s": round(statistics.median(checksum_s), 3),
                "checksum_over_save": _ratio(checksum_s, save_s),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
