import json

import pytest

from ttnpu.dsv4.bench import main


def test_bench_prints_one_json_line_of_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--flavors", "debug", "--seq-len", "16", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    (result,) = json.loads(lines[0])["results"]
    assert result["flavor"] == "debug" and result["ours_tokens_per_s"] > 0
    if result.get("hf") is None:  # transformers installed: measured side by side
        assert result["speedup_vs_hf"] > 0
