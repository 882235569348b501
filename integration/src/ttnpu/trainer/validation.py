"""One check of a parsed trainer config, before anything is built or written.

torchtitan validates many fields only where they are used: ``--training.steps -1`` fails an
assertion after the model is built, ``--training.steps 0`` "trains" and exits 0, a missing
tokenizer folder or dataset file surfaces as a traceback from deep inside the data loader. Here
every such field is checked at once against a table of rules, each naming the field and what it
expects, and the feature sections run their own cross-field checks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["check_config", "writable_folder"]


def _at_least(low: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda value: value >= low), f"an integer >= {low}"


def _minus_one_or_positive(meaning: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda value: value == -1 or value >= 1), f"-1 ({meaning}) or an integer >= 1"


def _existing_folder(value: str) -> bool:
    return Path(value).is_dir()


def _existing_path_or_none(value: str | None) -> bool:
    return value is None or Path(value).exists()


def writable_folder(value: str | Path) -> bool:
    """``value`` is a folder this process may write in, or can be created as one."""
    path = Path(value).absolute()
    while not path.exists():
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _registered_dataset(value: str) -> bool:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    return value in DATASETS


def _dataset_names() -> str:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    return "one of " + ", ".join(sorted(DATASETS))


_RULES: tuple[tuple[str, Callable[[Any], bool], str | Callable[[], str]], ...] = (
    ("training.steps", *_at_least(1)),
    ("training.local_batch_size", *_at_least(1)),
    ("training.global_batch_size", *_minus_one_or_positive("local batch x data-parallel ranks")),
    ("training.seq_len", *_at_least(1)),
    ("lr_scheduler.warmup_steps", *_at_least(0)),
    ("metrics.log_freq", *_at_least(1)),
    ("parallelism.data_parallel_replicate_degree", *_at_least(1)),
    ("parallelism.data_parallel_shard_degree", *_minus_one_or_positive("the remaining ranks")),
    ("parallelism.tensor_parallel_degree", *_at_least(1)),
    ("parallelism.context_parallel_degree", *_at_least(1)),
    ("parallelism.expert_parallel_degree", *_at_least(1)),
    ("hf_assets_path", _existing_folder, "an existing folder holding the tokenizer"),
    ("dataloader.dataset", _registered_dataset, _dataset_names),
    ("dataloader.dataset_path", _existing_path_or_none, "an existing file or folder"),
    ("dump_folder", writable_folder, "a folder this user can create and write"),
)
"""(field, rule, what is expected): a field's value that breaks its rule is refused."""


def check_config(config: Any) -> None:
    """Raise ``ValueError`` naming the first field of ``config`` (a ``DSV4Trainer.Config``)
    that is out of range, or the first feature section whose own check fails."""
    for name, holds, expected in _RULES:
        value = config
        for part in name.split("."):
            value = getattr(value, part)
        if not holds(value):
            wanted = expected() if callable(expected) else expected
            raise ValueError(f"--{name} {value}: expected {wanted}")
    for section in (config.fault_tolerance, config.sdc, config.spike):
        section.validate()
