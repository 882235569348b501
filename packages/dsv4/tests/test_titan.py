"""The torchtitan ModelSpec is optional: the package imports without it, and the spec builds
the plain model when torchtitan is there (integration/tests cover it inside torchtitan)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_importing_the_package_does_not_import_torchtitan() -> None:
    probe = "import sys, ttnpu.dsv4; print('torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_model_spec_wraps_the_plain_model_of_its_flavor() -> None:
    pytest.importorskip("torchtitan")
    from ttnpu.dsv4 import DeepSeekV4Config
    from ttnpu.dsv4.titan import DeepSeekV4LM, model_spec

    spec = model_spec("debug", vocab_size=512)
    lm = spec.model.build()
    assert isinstance(lm, DeepSeekV4LM)
    assert lm.model.config == DeepSeekV4Config.from_flavor("debug").replace(vocab_size=512)
    tokens = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    assert lm(tokens).shape == (1, 8, 512)
