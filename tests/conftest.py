"""Fixtures shared by every test package: the real offline models, materialised once."""

from __future__ import annotations

import pytest

from openrl_core.catalog import BUILTIN, SMOLLM2_135M, TINY_QWEN3


@pytest.fixture(scope="session")
def tiny_files():
    """The tiny Qwen3 (random weights, real Qwen tokenizer), built once per machine."""
    from functions.compute.models import materialize

    return materialize(BUILTIN[TINY_QWEN3])


@pytest.fixture(scope="session")
def smol_files():
    """The pretrained SmolLM2-135M-Instruct, dequantised from its GGUF once per machine."""
    from functions.compute.models import materialize

    return materialize(BUILTIN[SMOLLM2_135M])
