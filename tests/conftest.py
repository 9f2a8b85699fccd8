"""Shared fixtures. CUDA and GDS tests skip cleanly on machines without them."""
from __future__ import annotations

import pytest

from tierkv.device import has_cuda, has_cuda_driver


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_gds = pytest.mark.skip(reason="needs kvikio and a CUDA driver (libcuda.so.1)")
    for item in items:
        if "cuda" in item.keywords and not has_cuda():
            item.add_marker(skip_cuda)
        if "gds" in item.keywords and not has_cuda_driver():
            item.add_marker(skip_gds)
