"""``python -m ttnpu.trainer.bench``: what the trainer costs on top of the model, as ratios.

One process, dsv4_debug on the bundled corpus, measured side by side (alternating rounds):

- ``trainer_over_bare_step``: a ``DSV4Trainer.train_step`` (torchtitan's step: batch fetch, loss
  normalisation, grad clipping, optimizer, LR schedule, expert-bias update, metrics) over a bare
  loop on the same model and batches (``loss.backward()``, ``AdamW.step()``).
- ``checksum_over_save``: writing the SHA-256 manifest of a checkpoint over the DCP save itself.

Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .cli import single_process_env
from .config_registry import dsv4_debug
from .run_folder import write_checksums
from .trainer import DSV4Trainer

ROUNDS, STEPS = 3, 3
Batches = Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]


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


def _timed_trainer_steps(trainer: DSV4Trainer, batches: Batches) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        trainer.step += 1
        trainer.train_step(batches)
    return (time.perf_counter() - start) / STEPS


def _timed_bare_steps(
    trainer: DSV4Trainer, batches: Batches, optimizer: torch.optim.Optimizer
) -> float:
    model = trainer.model_parts[0]
    start = time.perf_counter()
    for _ in range(STEPS):
        inputs, labels = next(batches)
        optimizer.zero_grad()
        model(inputs["input"], labels=labels).backward()
        optimizer.step()
    return (time.perf_counter() - start) / STEPS


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        trainer = _build(folder)
        try:
            batches = trainer.batch_generator(trainer.dataloader)
            bare_optimizer = torch.optim.AdamW(trainer.model_parts[0].parameters(), lr=0.0)
            _timed_trainer_steps(trainer, batches)  # warm-up
            _timed_bare_steps(trainer, batches, bare_optimizer)
            trainer_s, bare_s = [], []
            for _ in range(ROUNDS):
                trainer_s.append(_timed_trainer_steps(trainer, batches))
                bare_s.append(_timed_bare_steps(trainer, batches, bare_optimizer))

            state = {
                "model": trainer.model_parts[0].state_dict(),
                "optimizer": trainer.optimizers.state_dict(),
            }
            save_s, checksum_s = [], []
            for i in range(ROUNDS):
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
                "trainer_step_s": round(statistics.median(trainer_s), 3),
                "bare_step_s": round(statistics.median(bare_s), 3),
                "trainer_over_bare_step": round(
                    statistics.median(t / b for t, b in zip(trainer_s, bare_s, strict=True)), 3
                ),
                "checkpoint_mb": round(checkpoint_mb, 1),
                "save_s": round(statistics.median(save_s), 3),
                "checksum_s": round(statistics.median(checksum_s), 3),
                "checksum_over_save": round(
                    statistics.median(c / s for c, s in zip(checksum_s, save_s, strict=True)), 3
                ),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
