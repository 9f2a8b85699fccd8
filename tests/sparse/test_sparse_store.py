import torch

from tierkv.config import TierConfig
from tierkv.manager import BlockingTierManager
from tierkv.model.sparse_engine import SparseEngine
from tierkv.sparse import SparseConfig
from tierkv.sparse.store import index_id, index_path, load_index, save_index

CFG = SparseConfig(budget=64, sink_tokens=8, window_tokens=32, page_tokens=16, outlier_fraction=0.05,
                   positions="original", dense_prefill_tokens=128)
IDS = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(7)).tolist()


def manager(lm, root):
    layout = SparseEngine.page_layout(lm, CFG)
    return BlockingTierManager.from_config(TierConfig(block_bytes=layout.page_bytes, gpu="128KiB", cpu=0,
                                                      nvme_dir=root / layout.name))


def prefilled(lm, root):
    """Prefill IDS[:-1] into a store under ``root``; returns (index file, logits of the next step)."""
    with manager(lm, root) as mgr:
        engine = SparseEngine(lm, mgr, CFG, chunk_tokens=64)
        key = index_id(lm.model_id, engine.layout, engine.resolved(len(IDS)), engine.needs, IDS[:-1])
        seq = engine.new_sequence(len(IDS), root=key, persist=True)
        engine.prefill(seq, IDS[:-1])
        mgr.flush()
        path = index_path(root / "indexes", key)
        save_index(seq, path)
        logits = engine.decode(seq, IDS[-1])
        seq.release(keep=True)
    return path, key, logits


def reopen(lm, root, path, key):
    """Load the stored index in a new manager; returns decode logits, or None when it is not reusable."""
    with manager(lm, root) as mgr:
        engine = SparseEngine(lm, mgr, CFG, chunk_tokens=64)
        seq = engine.new_sequence(len(IDS), root=key)
        if not load_index(seq, path):
            return None
        return engine.decode(seq, IDS[-1])


def test_a_stored_index_resumes_exactly(tiny_loaded, tmp_path):
    path, key, logits = prefilled(tiny_loaded, tmp_path)
    assert path.exists() and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    again = reopen(tiny_loaded, tmp_path, path, key)
    assert again is not None and torch.equal(again, logits)


def test_a_damaged_index_file_is_not_reused(tiny_loaded, tmp_path):
    path, key, _ = prefilled(tiny_loaded, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-50] ^= 0x10                                    # a byte inside the last tensor
    path.write_bytes(bytes(raw))
    assert reopen(tiny_loaded, tmp_path, path, key) is None
    path.write_bytes(b"not a safetensors file")
    assert reopen(tiny_loaded, tmp_path, path, key) is None


def test_an_index_whose_pages_are_gone_is_not_reused(tiny_loaded, tmp_path):
    path, key, _ = prefilled(tiny_loaded, tmp_path)
    with manager(tiny_loaded, tmp_path) as mgr:
        engine = SparseEngine(tiny_loaded, mgr, CFG)
        seq = engine.new_sequence(len(IDS), root=key)
        mgr.drop([seq.page_key(1, 3)])
    assert reopen(tiny_loaded, tmp_path, path, key) is None


def test_the_id_names_prompt_and_settings_but_not_prefetch(tiny_loaded):
    layout = SparseEngine.page_layout(tiny_loaded, CFG)
    base = index_id("m", layout, CFG, frozenset({"landmarks"}), IDS)
    assert base == index_id("m", layout, SparseConfig(**{**_fields(CFG), "prefetch": "none"}),
                            frozenset({"landmarks"}), IDS)
    assert base != index_id("m", layout, CFG, frozenset({"landmarks"}), IDS[:-1])
    assert base != index_id("m", layout, SparseConfig(**{**_fields(CFG), "budget": 128}),
                            frozenset({"landmarks"}), IDS)


def _fields(cfg):
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}
