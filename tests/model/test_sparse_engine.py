"""Sparse prefill and decode on tiny random models and on SmolLM2."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tierkv.config import TierConfig
from tierkv.errors import ConfigError
from tierkv.manager import BlockingTierManager
from tierkv.model.arch import model_spec
from tierkv.model.loading import LoadedModel
from policies.selectors import Landmarks
from tierkv.model.sparse_engine import SparseEngine
from tierkv.scoring import landmark_scores
from tierkv.sparse import SparseConfig
from tierkv.sparse.plan import WIDEN, WholePages
from tierkv.sparse.sequence import SparseSequence

from tinymodels import native_logits, tiny_model


def loaded(kind: str) -> LoadedModel:
    model = tiny_model(kind)
    return LoadedModel(model, None, f"tiny-{kind}", model_spec(model))


def run_sparse(lm: LoadedModel, ids: list[int], cfg: SparseConfig, steps: int = 3) -> list[torch.Tensor]:
    """Prefill ids[:-steps-1], then decode the rest one token at a time: logits after each."""
    layout = SparseEngine.page_layout(lm, cfg)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="256KiB",
                                                    cpu="8MiB")) as manager:
        engine = SparseEngine(lm, manager, cfg, chunk_tokens=64)
        seq = engine.new_sequence(len(ids) - steps)
        engine.prefill(seq, ids[:-steps - 1])
        return [engine.decode(seq, t) for t in ids[-steps - 1:]]


def decoded_sequence(lm: LoadedModel, ids: list[int], cfg: SparseConfig, steps: int) -> SparseSequence:
    """The sequence after prefilling ids[:-steps] and decoding the last ``steps`` tokens (finite logits)."""
    layout = SparseEngine.page_layout(lm, cfg)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="256KiB",
                                                    cpu="8MiB")) as manager:
        engine = SparseEngine(lm, manager, cfg, chunk_tokens=64)
        seq = engine.new_sequence(len(ids))
        engine.prefill(seq, ids[:-steps])
        for token in ids[-steps:]:
            assert torch.isfinite(engine.decode(seq, token)).all()
        return seq


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_full_rank_and_full_budget_equal_dense_attention(kind):
    """Sparse prefill past the exact part, pages sealed and spilled to the cpu tier: still exact."""
    lm = loaded(kind)
    dims = lm.spec.num_kv_heads * lm.spec.head_dim
    cfg = SparseConfig(budget=10_000, rank=dims, sink_tokens=8, window_tokens=32, page_tokens=16,
                       outlier_fraction=0.05, positions="original", dense_prefill_tokens=100)
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    got = run_sparse(lm, ids[0].tolist(), cfg)
    want = native_logits(lm.model, ids, chunk=64, block=64)[0, -4:]
    assert torch.allclose(torch.stack(got), want, atol=2e-4)


def test_a_small_budget_changes_the_result_and_stays_finite():
    lm = loaded("llama")
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(4)).tolist()
    full = SparseConfig(budget=10_000, rank=32, sink_tokens=8, window_tokens=32, page_tokens=16,
                        positions="original", dense_prefill_tokens=100)
    small = SparseConfig(budget=16, rank=8, sink_tokens=8, window_tokens=32, page_tokens=16,
                         positions="original", dense_prefill_tokens=100, selector="quest")
    a, b = torch.stack(run_sparse(lm, ids, full)), torch.stack(run_sparse(lm, ids, small))
    assert torch.isfinite(b).all() and not torch.allclose(a, b, atol=1e-3)


def test_remapped_positions_run_past_the_trained_window():
    lm = loaded("llama")                                   # trained window 512
    ids = torch.randint(0, 128, (1300,), generator=torch.Generator().manual_seed(5)).tolist()
    cfg = SparseConfig(budget=64, sink_tokens=8, window_tokens=64, page_tokens=16)
    resolved = cfg.resolve(prompt_tokens=1300, trained_tokens=lm.spec.max_position)
    assert (resolved.positions, resolved.dense_prefill_tokens) == ("remap", 256)
    out = run_sparse(lm, ids, cfg, steps=2)
    assert all(torch.isfinite(x).all() for x in out)


def test_remap_with_everything_attended_equals_dense_within_the_window():
    """Remapped positions are the real ones when nothing is left out: same logits as dense."""
    lm = loaded("llama")
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(6))
    cfg = SparseConfig(budget=10_000, rank=32, sink_tokens=8, window_tokens=32, page_tokens=16,
                       outlier_fraction=0.0, positions="remap", dense_prefill_tokens=300)
    got = run_sparse(lm, ids[0].tolist(), cfg, steps=0)
    want = native_logits(lm.model, ids, chunk=64, block=64)[0, -1]
    assert torch.allclose(got[0], want, atol=2e-4)


@pytest.mark.parametrize("prefetch", ["speculative", "previous-step"])
def test_a_prefetcher_changes_what_loads_not_the_logits(prefetch):
    """Pages spill past a small gpu tier; guessed pages enter it cold: the logits stay those of none."""
    lm = loaded("llama")
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(7)).tolist()
    cfg = SparseConfig(budget=64, rank=16, sink_tokens=8, window_tokens=32, page_tokens=16,
                       positions="original", dense_prefill_tokens=100, prefetch="none")
    want = torch.stack(run_sparse(lm, ids, cfg, steps=4))
    assert torch.equal(torch.stack(run_sparse(lm, ids, replace(cfg, prefetch=prefetch), steps=4)), want)


@pytest.mark.parametrize("page_dtype,most", [("int8", 0.02), ("int4", 0.3)])
def test_quantized_pages_at_full_budget_stay_near_dense_attention(page_dtype, most):
    lm = loaded("llama")
    dims = lm.spec.num_kv_heads * lm.spec.head_dim
    cfg = SparseConfig(budget=10_000, rank=dims, sink_tokens=8, window_tokens=32, outlier_fraction=0.0,
                       positions="original", dense_prefill_tokens=100, page_dtype=page_dtype)
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    got = torch.stack(run_sparse(lm, ids[0].tolist(), cfg))
    want = native_logits(lm.model, ids, chunk=64, block=64)[0, -4:]
    exact = torch.stack(run_sparse(lm, ids[0].tolist(), replace(cfg, page_dtype=None)))
    assert torch.allclose(exact, want, atol=1e-3)
    error = float((got - want).abs().max() / want.abs().max())
    assert 0 < error < most          # lossy, by about what its bits allow


@pytest.mark.model
def test_smollm2_a_quantized_store_serves_its_own_codec_only(smollm2, tmp_path):
    from tierkv.session.run import run
    from tierkv.model.settings import RunConfig
    config = RunConfig.of(synthetic_tokens=1200, max_new_tokens=6, mode="sparse", sparse_budget=256,
                          gpu_budget="4MiB", cpu_budget="8MiB", nvme_dir=tmp_path, page_dtype="int4")
    first, second = run(config, loaded=smollm2), run(config, loaded=smollm2)
    other = run(config.updated(page_dtype="int8"), loaded=smollm2)
    assert first.found and second.text == first.text and other.found
    assert (first.reused_prompt_tokens, second.reused_prompt_tokens, other.reused_prompt_tokens) == (0, 1199, 0)
    assert first.sparse["page_tokens"] == 56 and other.sparse["page_tokens"] == 80
    stores = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sparse-P"))
    assert [name.split("-", 6)[-1] for name in stores] == ["int4t64f16-int4c56f16", "int8t64f16-int8c80f16"]


@pytest.mark.model
def test_smollm2_sparse_run_finds_the_passkey_and_reuses_its_prefill(smollm2, tmp_path):
    from tierkv.session.run import run
    from tierkv.model.settings import RunConfig
    config = RunConfig.of(synthetic_tokens=1200, max_new_tokens=6, mode="sparse", sparse_budget=256,
                       gpu_budget="4MiB", cpu_budget="8MiB", nvme_dir=tmp_path, page_dtype="bfloat16")
    first = run(config, loaded=smollm2)
    second = run(config, loaded=smollm2)
    assert first.mode == "sparse" and first.found and second.found
    assert (first.reused_prompt_tokens, second.reused_prompt_tokens) == (0, 1199)
    assert second.text == first.text
    assert first.sparse["budget_tokens"] == 256 and first.sparse["pages_read"] > 0
    assert first.sparse["attend"] == "pages"
    assert first.tiers["nvme"]["bytes_written"] > 0
    waiting = run(config.updated(no_sparse_overlap=True), loaded=smollm2)    # a decode-only setting:
    assert waiting.reused_prompt_tokens == 1199 and waiting.found              # the stored index serves it
    assert first.sparse["overlap"] and not waiting.sparse["overlap"]           # overlap is the default


def test_decode_widens_to_the_pages_read_at_most_twice_the_selection():
    """attend="pages": a head attends the indexed chunks of the pages its layer read, all of them
    (the same for every head) while they are at most twice its own; past that its own chunks plus
    the best-scored others, from those pages only."""
    lm = loaded("llama")
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(8)).tolist()
    cfg = SparseConfig(budget=32, rank=32, sink_tokens=8, window_tokens=32, page_tokens=32,
                       positions="original", dense_prefill_tokens=100)
    assert cfg.attend == "pages" and WIDEN == 2
    seq = decoded_sequence(lm, ids, cfg, steps=1)
    H, per = lm.spec.num_kv_heads, cfg.page_tokens // cfg.chunk_tokens
    query = torch.randn(lm.spec.num_heads, lm.spec.head_dim, generator=torch.Generator().manual_seed(9))
    free = seq.index(0).candidates.nonzero().flatten()
    one_page = free[free // per == int(free[0]) // per]          # the candidates of one page
    few = one_page[:max(1, len(one_page) // 2)].expand(H, -1)
    wide, shared = WholePages().widen(seq, 0, query, few)
    assert shared and wide.shape[1] <= WIDEN * few.shape[1]
    assert all(row.tolist() == one_page.tolist() for row in wide)
    spread = torch.stack([free[h::per + 1][:3] for h in range(H)])  # chunks on many pages
    read = set(seq.page_chunks(0, spread).tolist())
    assert len(read) > WIDEN * spread.shape[1]
    wide, shared = WholePages().widen(seq, 0, query, spread)
    assert not shared and wide.shape == (H, WIDEN * spread.shape[1])
    for h in range(H):
        assert set(spread[h].tolist()) <= set(wide[h].tolist()) <= read
        assert wide[h].tolist() == sorted(wide[h].tolist())


def test_the_widening_takes_the_selection_s_scores_and_picks_what_scoring_again_would():
    lm = loaded("llama")
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(8)).tolist()
    cfg = SparseConfig(budget=32, rank=32, sink_tokens=8, window_tokens=32, page_tokens=32,
                       positions="original", dense_prefill_tokens=100)
    seq = decoded_sequence(lm, ids, cfg, steps=1)
    index, per = seq.index(0), cfg.page_tokens // cfg.chunk_tokens
    query = torch.randn(lm.spec.num_heads, lm.spec.head_dim, generator=torch.Generator().manual_seed(9))
    chunks, scores = Landmarks().select_scored(query, index, 3)
    assert torch.equal(chunks, Landmarks().select(query, index, 3))
    assert torch.equal(scores, landmark_scores(query, index.landmarks, index.landmark_scale))
    free = index.candidates.nonzero().flatten()
    spread = torch.stack([free[h::per + 1][:3] for h in range(lm.spec.num_kv_heads)])   # on many pages
    again, _ = WholePages().widen(seq, 0, query, spread)
    shared, _ = WholePages().widen(seq, 0, query, spread, scores)
    assert again.shape[1] < seq.page_chunks(0, spread).numel() and torch.equal(shared, again)
    assert not torch.equal(WholePages().widen(seq, 0, query, spread, -scores)[0], again)   # they are used


def test_with_remapped_positions_the_widened_set_stays_inside_the_trained_window():
    lm = loaded("llama")                                   # trained window 512
    ids = torch.randint(0, 128, (1300,), generator=torch.Generator().manual_seed(5)).tolist()
    cfg = SparseConfig(budget=256, sink_tokens=8, window_tokens=64, page_tokens=32, positions="remap",
                       dense_prefill_tokens=256)
    seq = decoded_sequence(lm, ids, cfg, steps=1)
    H, c = lm.spec.num_kv_heads, cfg.chunk_tokens
    free = seq.index(0).candidates.nonzero().flatten()
    spread = torch.stack([free[h::3][:32] for h in range(H)])      # 32 chunks a head, over many pages
    fixed = cfg.sink_tokens + cfg.window_tokens + len(seq.index(0).outliers) * c
    limit = (lm.spec.max_position - fixed - 1) // c
    assert 32 < limit < 64 and seq.page_chunks(0, spread).numel() > limit
    wide, shared = WholePages().widen(seq, 0, torch.randn(lm.spec.num_heads, lm.spec.head_dim), spread)
    assert wide.shape == (H, limit) and fixed + limit * c < lm.spec.max_position


def test_a_layer_budget_widens_that_layer_only():
    lm = loaded("llama")
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(6)).tolist()
    cfg = SparseConfig(budget=16, layer_budgets="0:10000", rank=32, sink_tokens=8, window_tokens=32,
                       page_tokens=16, positions="original", dense_prefill_tokens=100)
    seq = decoded_sequence(lm, ids, cfg, steps=1)
    candidates = int(seq.index(0).candidates.sum())
    assert seq.chosen[0].shape[-1] == candidates > 2
    assert all(seq.chosen[layer].shape[-1] == 2 for layer in range(1, lm.spec.num_layers))


def test_a_layer_budget_must_name_a_layer_of_the_model():
    lm = loaded("llama")
    cfg = SparseConfig(layer_budgets="99:4096", page_tokens=16)
    layout = SparseEngine.page_layout(lm, cfg)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="256KiB")) as manager:
        with pytest.raises(ConfigError, match=f"layer 99 is not in the model: it has {lm.spec.num_layers} layers"):
            SparseEngine(lm, manager, cfg)


@pytest.mark.parametrize("allocation", ["adaptive", "uniform"])
def test_adaptive_budgets_move_chunks_between_layers_at_the_same_total(allocation):
    lm = loaded("llama")
    ids = torch.randint(0, 128, (600,), generator=torch.Generator().manual_seed(7)).tolist()
    cfg = SparseConfig(budget=64, rank=32, sink_tokens=8, window_tokens=32, page_tokens=16,
                       positions="original", dense_prefill_tokens=100, allocation=allocation)
    seq = decoded_sequence(lm, ids, cfg, steps=3)
    uniform = 64 // cfg.chunk_tokens
    chosen = [seq.chosen[layer].shape[-1] for layer in range(lm.spec.num_layers)]
    if allocation == "uniform":
        assert chosen == [uniform] * lm.spec.num_layers
    else:     # estimated after the first step: shares differ, the total does not grow
        assert len(set(chosen)) > 1 and sum(chosen) <= uniform * lm.spec.num_layers
        assert min(chosen) >= uniform // 4


@pytest.mark.parametrize("positions,sinks,window,gpu_pages", [
    ("original", 8, 32, 52), ("remap", 8, 32, 52), ("original", 0, 0, 52), ("original", 8, 32, 20)])
def test_overlapped_decode_over_pages_on_nvme_equals_dense_attention(positions, sinks, window, gpu_pages,
                                                                     tmp_path, monkeypatch):
    """Full rank and budget, about half the pages only on NVMe at each read: attending to the pages
    in place while the rest load, then to those, is still exact (and so equal to decoding without
    overlap). With neither sinks nor window, a head could have nothing in place to attend to when
    the window is empty: that read is not split. With 20 gpu pages a read goes in groups of 10,
    the last one split. The buffers pages are copied into start as NaNs (bytes 0xFF), so the rows of
    pages still loading must be kept out of the first pass, not found zero by chance."""
    import transformers
    from tinymodels import TINY
    from tierkv.sparse import reads
    from tierkv.sparse.sequence import Loading
    monkeypatch.setattr(reads, "pages_buffer",
                        lambda pages, block_bytes: torch.full((pages, block_bytes), 255, dtype=torch.uint8))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY | {"num_hidden_layers": 4}))
    lm = LoadedModel(model.eval().requires_grad_(False), None, "tiny-llama-4", model_spec(model))
    dims = lm.spec.num_kv_heads * lm.spec.head_dim
    # 399 tokens prefilled: ~25 pages a layer, 100 in all; the gpu tier holds 52 (a read pins at most
    # half of it). Without a window the second step finds the window empty.
    ids = torch.randint(0, 128, (1, 403), generator=torch.Generator().manual_seed(3))[0].tolist()
    finished = []
    real_finish = Loading.finish
    monkeypatch.setattr(Loading, "finish", lambda self: finished.append(1) or real_finish(self))
    logits = {}
    for overlap in (False, True):
        cfg = SparseConfig(budget=10_000, rank=dims, sink_tokens=sinks, window_tokens=window, page_tokens=16,
                           outlier_fraction=0.05, positions=positions, dense_prefill_tokens=100, overlap=overlap)
        layout = SparseEngine.page_layout(lm, cfg)
        tiers = TierConfig(block_bytes=layout.block_bytes, gpu=gpu_pages * layout.block_bytes, cpu=0,
                           nvme_dir=tmp_path / str(overlap))
        with BlockingTierManager.from_config(tiers) as manager:
            engine = SparseEngine(lm, manager, cfg, chunk_tokens=64)
            seq = engine.new_sequence(len(ids) - 3)
            engine.prefill(seq, ids[:-4])
            logits[overlap] = torch.stack([engine.decode(seq, t) for t in ids[-4:]])
        assert bool(finished) == overlap            # reads were split, and only with overlap
    assert torch.allclose(logits[True], logits[False], atol=1e-4)
    if positions == "original":
        want = native_logits(lm.model, torch.tensor([ids]), chunk=64, block=64)[0, -4:]
        assert torch.allclose(logits[True], want, atol=2e-4)


def test_a_recorded_sparse_run_marks_each_prefill_chunk_and_decode_step():
    from tierkv.profile.access import STEP_KINDS, AccessRecorder
    lm, cfg = loaded("llama"), SparseConfig(budget=16, rank=8, sink_tokens=8, window_tokens=32, page_tokens=16,
                                            positions="original", dense_prefill_tokens=100)
    layout = SparseEngine.page_layout(lm, cfg)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="256KiB",
                                                    cpu="8MiB")) as manager:
        recorder = AccessRecorder().attach(manager.manager)
        engine = SparseEngine(lm, manager, cfg, chunk_tokens=64)
        ids = [3 + i % 120 for i in range(197)]
        seq = engine.new_sequence(len(ids) + 3)
        engine.prefill(seq, ids)
        for token in (5, 6, 7):
            engine.decode(seq, token)
        trace = recorder.trace(manager.manager)
    kinds = [STEP_KINDS[k] for k in trace.step_kind]
    assert kinds == ["prefill"] * 4 + ["decode"] * 3      # chunks 0-64, 64-100 (exact part ends), 100-164, 164-197
    assert trace.n_ops > 0 and trace.op_step.max() == trace.n_steps - 1


def test_a_crop_takes_back_the_newest_tokens_exactly():
    """Decode a, b, c; crop two; decode b, c again: the same logits, pages sealed on the way and all."""
    lm = loaded("llama")
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    cfg = SparseConfig(budget=64, rank=32, sink_tokens=8, window_tokens=32, page_tokens=16, positions="original",
                       dense_prefill_tokens=100)
    layout = SparseEngine.page_layout(lm, cfg)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="4MiB")) as manager:
        engine = SparseEngine(lm, manager, cfg, chunk_tokens=64)
        seq = engine.new_sequence(len(ids))
        engine.prefill(seq, ids[:-3])
        first = [engine.decode(seq, t) for t in ids[-3:]]
        pages = len(seq.all_pages())
        seq.crop(2)
        assert seq.length(0) == len(ids) - 2
        again = [engine.decode(seq, t) for t in ids[-2:]]
        assert len(seq.all_pages()) == pages
        for a, b in zip(first[1:], again):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="window"):
            seq.crop(100)
