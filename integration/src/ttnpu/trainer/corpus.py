"""The bundled corpus and tokenizer, served through torchtitan's dataset and tokenizer interfaces.

Both ship as package data under ``assets/`` (origin and license in ``assets/SOURCE.md``; rebuilt by
``tools/prepare_corpus.py``). The corpus is registered in torchtitan's dataset table under
:data:`DATASET_NAME`, so ``HuggingFaceTextDataLoader`` packs, shards and checkpoints it like any
other dataset; the tokenizer folder is a Hugging Face ``tokenizer.json`` that torchtitan's
``HuggingFaceTokenizer`` loads. Nothing here touches the network.
"""

from __future__ import annotations

import gzip
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

__all__ = ["DATASET_NAME", "corpus_path", "load_corpus", "register_dataset", "tokenizer_path"]

DATASET_NAME = "ttnpu_shakespeare"
_ASSETS = Path(str(files("ttnpu.trainer") / "assets"))


def corpus_path() -> str:
    return str(_ASSETS / "corpus" / "shakespeare.jsonl.gz")


def tokenizer_path() -> str:
    return str(_ASSETS / "tokenizer")


def load_corpus(path: str) -> Dataset:
    """A map-style dataset of ``{"text", "work", "part"}`` records from a ``.jsonl.gz`` file
    (map-style, so torchtitan resumes it by sample index)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
    except FileNotFoundError as err:
        raise FileNotFoundError(f"corpus file {path} does not exist") from err
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"corpus file {path} is not a valid gzip JSON-lines file: {err}") from err
    if not records or not all(
        isinstance(r, dict) and isinstance(r.get("text"), str) for r in records
    ):
        raise ValueError(f"corpus file {path} must hold JSON records with a 'text' string")
    return Dataset.from_list(records)


def _text(sample: dict[str, Any]) -> str:
    return str(sample["text"])


def register_dataset() -> None:
    """Make ``--dataloader.dataset ttnpu_shakespeare`` resolve to the bundled corpus (idempotent);
    ``--dataloader.dataset_path`` may point at another file of the same format."""
    DATASETS[DATASET_NAME] = DatasetConfig(
        path=corpus_path(), loader=load_corpus, sample_processor=_text
    )
