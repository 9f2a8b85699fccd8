"""A tiny random Llama as a LoadedModel, and a tier manager for pages."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))


@pytest.fixture(scope="module")
def tiny_loaded():
    from tinymodels import tiny_model

    from tierkv.model.arch import model_spec
    from tierkv.model.loading import LoadedModel
    model = tiny_model("llama")
    return LoadedModel(model, None, "tiny-llama", model_spec(model))
