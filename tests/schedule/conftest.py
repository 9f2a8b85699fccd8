"""Fixtures of the schedule tests.

The repository root goes first on ``sys.path``: under ``pytest`` (not ``python -m pytest``) the
rootdir-inserted ``tests/`` would otherwise make ``tests/policies`` shadow the ``policies`` package.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
from schedmodels import loaded_tiny  # noqa: E402

from tierkv.model.loading import LoadedModel  # noqa: E402


@pytest.fixture
def tiny() -> LoadedModel:
    return loaded_tiny()
