"""What /metrics exports, from a real session: with a remote store, its block counts by mode."""
from tierkv.model.arch import model_spec
from tierkv.model.loading import LoadedModel
from tierkv.model.settings import SessionConfig
from tierkv.serve.metrics import Metrics
from tierkv.session import Session

from tinymodels import tiny_model


def test_the_remote_store_s_counts_are_exported(redis_server, tmp_path):
    model = tiny_model("llama")
    loaded = LoadedModel(model, None, "tiny-llama", model_spec(model))
    config = SessionConfig.of(nvme_dir=tmp_path / "store", remote=redis_server.url, mode="dense",
                              gpu_budget="1MiB", cpu_budget="1MiB", block_tokens=16, chunk_tokens=64)
    with Session(config, loaded=loaded) as session:
        session.complete(list(range(1, 100)), max_new_tokens=2)
        session.backends["dense"].manager.flush()
        metrics = Metrics()
        metrics.refresh(session)
        text = metrics.text().decode()
    written = [line for line in text.splitlines() if line.startswith('tierkv_remote_blocks{mode="dense",what="written"}')]
    assert written and float(written[0].split()[-1]) > 0, text
    assert 'what="corrupt"} 0.0' in text
