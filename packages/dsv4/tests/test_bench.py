import importlib.util
import json

import pytest

from ttnpu.dsv4 import bench
from ttnpu.dsv4.bench import main

FIGURES = ("tokens_per_s", "step_s", "peak_mib")


def test_help_describes_the_options_without_running(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("--help ran the benchmark")

    monkeypatch.setattr(bench, "bench_case", refuse)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--compile-backend" in out and "--backends" in out and "{" not in out


def test_micro_bench_prints_one_json_line_with_every_variant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Both CPU backends and the full loss, and transformers when it is installed (compiling the
    blocks takes dynamo minutes on 2 cores: the compiled path is ac_compile's, tested there)."""
    main(["--flavors", "micro", "--seq-len", "8", "--repeats", "1", "--compile-backend", "none"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["device"] == "cpu" and report["compile_backend"] == "none"
    (result,) = report["results"]
    assert (result["flavor"], result["seq_len"], result["batch"]) == ("micro", 8, 1)
    ours = {"reference", "chunked", "chunked+full_loss"}
    has_hf = importlib.util.find_spec("transformers") is not None
    variants = result["variants"]
    assert set(variants) == ours | ({"transformers"} if has_hf else set())
    for name, figures in variants.items():
        assert all(figures[key] > 0 for key in FIGURES), (name, figures)
    if has_hf:
        assert result["transformers"]["attn_implementation"] == "eager"
        for ratios in (result["speedup_vs_transformers"], result["peak_memory_vs_transformers"]):
            assert set(ratios) == ours and all(r > 0 for r in ratios.values())


def test_a_variant_that_fails_reports_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--flavors", "micro", "--seq-len", "8", "--repeats", "1", "--no-hf"]
    main([*argv, "--backends", "reference", "--compile-backend", "no_such_backend"])
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert "no_such_backend" in result["variants"]["reference+compile"]["error"]
    assert result["variants"]["reference"]["tokens_per_s"] > 0
    assert "speedup_vs_transformers" not in result
