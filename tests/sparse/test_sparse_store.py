import pytest
import torch
from safetensors import SafetensorError

from tierkv.config import TierConfig
from tierkv.manager import BlockingTierManager
from tierkv.model.sparse_engine import SparseEngine
from tierkv.sparse import SparseConfig
from tierkv.errors import DiskFullError, StoreWriteError
from tierkv.sparse.store import Shelf, _not_written, identity_key, index_id, load_index, save_index, write_checked

CFG = SparseConfig(budget=64, sink_tokens=8, window_tokens=32, page_tokens=16, outlier_fraction=0.05,
                   positions="original", dense_prefill_tokens=128,
                   overlap=False)    # bit for bit: a reopened store's reads split where the first run's did not
IDS = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(7)).tolist()


def manager(lm, root):
    layout = SparseEngine.page_layout(lm, CFG)
    return BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="128KiB", cpu=0,
                                                      nvme_dir=root / layout.name))


def prefilled(lm, root):
    """Prefill IDS[:-1] into a store under ``root``; returns (index file, logits of the next step)."""
    with manager(lm, root) as mgr:
        engine = SparseEngine(lm, mgr, CFG, chunk_tokens=64)
        shelf = Shelf(root / "indexes", identity_key(lm.model_id, engine.layout, CFG, engine.needs))
        key, path = shelf.key(IDS[:-1]), shelf.path(IDS[:-1])
        seq = engine.new_sequence(len(IDS), root=key, persist=True)
        engine.prefill(seq, IDS[:-1])
        mgr.flush()
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
        mgr.drop(seq.page_key_run(1, 3, 1))
    assert reopen(tiny_loaded, tmp_path, path, key) is None


def test_the_id_names_prompt_and_the_settings_that_shape_the_index_only(tiny_loaded):
    layout = SparseEngine.page_layout(tiny_loaded, CFG)
    base = index_id("m", layout, CFG, frozenset({"landmarks"}), IDS)
    for field, value in (("prefetch", "none"), ("prefetch", "speculative"), ("attend", "chunks"), ("budget", 128),
                         ("overlap", True), ("allocation", "adaptive")):
        assert base == index_id("m", layout, SparseConfig(**{**_fields(CFG), field: value}),
                                frozenset({"landmarks"}), IDS)
    assert base != index_id("m", layout, CFG, frozenset({"landmarks"}), IDS[:-1])
    for field, value in (("prefill_budget", 128), ("window_tokens", 64), ("selector", "quest")):
        assert base != index_id("m", layout, SparseConfig(**{**_fields(CFG), field: value}),
                                frozenset({"landmarks"}), IDS)


def _fields(cfg):
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


class Stop(Exception):
    pass


def test_float_pages_of_another_compute_dtype_are_another_identity(tiny_loaded, tmp_path):
    """float32 pages of a bfloat16 run hold its KV widened: a float32 run would have computed other KV, so
    it does not take them (quantized pages and pages in the model's dtype name the dtype in their layout)."""
    import copy
    from dataclasses import replace

    from tierkv.model.arch import model_spec
    from tierkv.model.loading import LoadedModel
    from tierkv.session.prefill import shelf_of
    half = copy.deepcopy(tiny_loaded.model).to(torch.bfloat16)
    half = LoadedModel(half, None, tiny_loaded.model_id, model_spec(half))

    def identity(lm, **settings):
        config = replace(CFG, **settings)
        layout = SparseEngine.page_layout(lm, config)
        with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="128KiB", cpu=0)) as mgr:
            engine = SparseEngine(lm, mgr, config, chunk_tokens=64)
            return shelf_of(engine, tmp_path).identity, identity_key(lm.model_id, layout, config, engine.needs)

    assert identity(half, page_dtype="float32")[0] != identity(tiny_loaded, page_dtype="float32")[0]
    for lm, settings in ((tiny_loaded, {"page_dtype": "float32"}), (half, {}), (half, {"page_dtype": "int8"})):
        given, before = identity(lm, **settings)       # where the pages say it, the identity stores had before
        assert given == before


def run_open(lm, root, *, stop_after=None, checkpoint_s=1e-9):
    """open_sparse on IDS with the store under ``root`` (a checkpoint after every chunk); with
    ``stop_after``, the run is stopped once that many tokens are prefilled. Returns (reused, logits)."""
    from tierkv.session.prefill import shelf_of, sparse_state
    done = [0]

    def progress(n):
        done[0] += n
        if stop_after is not None and done[0] >= stop_after:
            raise Stop
    with manager(lm, root) as mgr:
        engine = SparseEngine(lm, mgr, CFG, chunk_tokens=64)
        opened = sparse_state(engine, IDS[:-1], shelf_of(engine, root), checkpoint_every=checkpoint_s,
                              progress=progress)
        seq, reused = opened.state.seq, max(opened.reused, opened.resumed)
        logits = engine.decode(seq, IDS[-1])
        seq.release(keep=True)
    return reused, logits


def partial_files(root):
    return sorted(p.name for p in (root / "sparse-indexes").glob("*.partial.safetensors"))


def test_a_stopped_prefill_resumes_at_its_checkpoint_and_ends_as_an_unstopped_one(tiny_loaded, tmp_path):
    reused, whole = run_open(tiny_loaded, tmp_path / "whole")
    assert reused == 0 and partial_files(tmp_path / "whole") == []
    stopped = tmp_path / "stopped"
    with pytest.raises(Stop):
        run_open(tiny_loaded, stopped, stop_after=256)       # chunks of 64: the last checkpoint is at 192
    assert len(partial_files(stopped)) == 1
    reused, resumed = run_open(tiny_loaded, stopped)
    assert reused == 192
    assert torch.equal(resumed, whole)
    assert partial_files(stopped) == []                      # the finished index replaces the checkpoint
    assert run_open(tiny_loaded, stopped)[0] == len(IDS) - 1


def test_a_damaged_checkpoint_means_prefilling_from_the_start(tiny_loaded, tmp_path):
    _, whole = run_open(tiny_loaded, tmp_path / "whole")
    with pytest.raises(Stop):
        run_open(tiny_loaded, tmp_path, stop_after=256)
    (partial,) = (tmp_path / "sparse-indexes").glob("*.partial.safetensors")
    raw = bytearray(partial.read_bytes())
    raw[-20] ^= 0x01
    partial.write_bytes(bytes(raw))
    reused, logits = run_open(tiny_loaded, tmp_path)
    assert reused == 0 and torch.equal(logits, whole)


def test_no_checkpoints_when_turned_off(tiny_loaded, tmp_path):
    with pytest.raises(Stop):
        run_open(tiny_loaded, tmp_path, stop_after=256, checkpoint_s=0)
    assert not (tmp_path / "sparse-indexes").exists() or partial_files(tmp_path) == []


def test_an_index_in_the_first_file_layout_resumes_exactly(tiny_loaded, tmp_path):
    """Files written before landmarks were saved per KV head (version 1) still load."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tierkv.sparse.store import _digest
    path, key, logits = prefilled(tiny_loaded, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    for layer in range(len(json.loads(meta["pages"]))):
        heads = sorted(n for n in tensors if n.startswith(f"L{layer}.landmarks.h"))
        tensors[f"L{layer}.landmarks"] = torch.stack([tensors.pop(n) for n in heads], dim=1)
    meta |= {"version": "1", "checksums": json.dumps({n: _digest(t) for n, t in tensors.items()})}
    save_file(tensors, str(path), metadata=meta)
    again = reopen(tiny_loaded, tmp_path, path, key)
    assert again is not None and torch.equal(again, logits)


def test_a_failed_load_leaves_the_sequence_untouched(tiny_loaded, tmp_path):
    import json
    import struct
    path, key, _ = prefilled(tiny_loaded, tmp_path)
    raw = bytearray(path.read_bytes())
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    last = tiny_loaded.spec.num_layers - 1
    start, _ = header[f"L{last}.sink_v"]["data_offsets"]   # the last layer: every earlier one reads fine
    raw[8 + size + start] ^= 0x10
    path.write_bytes(bytes(raw))
    with manager(tiny_loaded, tmp_path) as mgr:
        engine = SparseEngine(tiny_loaded, mgr, CFG, chunk_tokens=64)
        seq = engine.new_sequence(len(IDS), root=key)
        layers = list(seq.layers)
        assert load_index(seq, path) is None
        assert seq.layers == layers and all(s.length == 0 and not s.pages for s in seq.layers)


def test_a_stored_prefill_keeps_its_name_across_releases():
    """A new setting must not rename every stored index (a 1M-token prefill takes hours): the name
    below was computed when an index came to be named by the tokens it covers, under the settings
    that shape it (``INDEX_FIELDS``, as given: resolving them depends on the tokens only). Change
    it only on purpose."""
    from tierkv.layout import BlockLayout
    layout = BlockLayout.page(32, 3, 64, 192, torch.bfloat16)
    ids = list(range(999))
    key = index_id("smollm2", layout, SparseConfig(page_tokens=32), frozenset({"landmarks"}), ids)
    assert key.hex() == "ed535171e7be1d68f24ff66e5ecf7047"
    wider = SparseConfig(page_tokens=32, layer_budgets="0:6144")
    assert index_id("smollm2", layout, wider, frozenset({"landmarks"}), ids) == key   # decode-only setting


def test_an_index_that_cannot_be_written_is_a_store_error_and_leaves_no_file(tmp_path):
    """safetensors' own error says its cause only in words: it used to end a run with a traceback."""
    import resource
    import signal
    path = tmp_path / "x.safetensors"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, limit[1]))    # a write past 64 KiB fails (EFBIG)
    try:
        with pytest.raises(StoreWriteError, match=r"sparse index .*x.safetensors: cannot be written \(File too large"):
            write_checked(path, {"a": torch.zeros(1 << 16)}, {"version": "3"}, "index")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, ignored)
    assert list(tmp_path.iterdir()) == []
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert isinstance(_not_written(path, full, 1 << 20), DiskFullError)
