import pytest
import torch

from tierkv.sparse.index import ChunkIndex


def smooth_keys(chunks: int, seed: int = 0) -> torch.Tensor:
    """Keys that vary slowly inside each 8-token chunk: every landmark describes its chunk well."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(chunks, 1, 2, 16, generator=g)
    return (base + 0.05 * torch.randn(chunks, 8, 2, 16, generator=g)).reshape(-1, 2, 16)


def test_planted_outlier_chunks_are_found_and_kept_exact():
    keys = smooth_keys(200)
    planted = [17, 93, 150]
    for c in planted:
        keys[c * 8 + 3] = -keys[c * 8 + 3] * 5             # one token points away from its chunk
    values = torch.randn_like(keys)
    index = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.float32)
    for start in range(0, 200 * 8, 40 * 8):                # arrives in five batches
        index.add(keys[start:start + 320], keys[start:start + 320], values[start:start + 320],
                  target_outliers=3)
    assert sorted(index.outliers) == planted
    ids, k, v = index.exact()
    assert ids.tolist() == planted
    assert torch.equal(k[8:16], keys[93 * 8:94 * 8]) and torch.equal(v[16:], values[150 * 8:151 * 8])
    assert index.candidates.sum().item() == 197 and not index.candidates[planted].any()


def test_summaries_are_means_and_bounds():
    keys = smooth_keys(10)
    index = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks", "bounds"}), dtype=torch.float32)
    index.add(keys, keys, keys, target_outliers=0)
    chunked = keys.view(10, 8, 2, 16)
    assert torch.allclose(index.landmarks, chunked.mean(1))
    assert torch.equal(index.lo, chunked.amin(1)) and torch.equal(index.hi, chunked.amax(1))
    assert index.candidates.all() and not index.outliers


def test_state_round_trip():
    keys = smooth_keys(30)
    keys[5 * 8] *= -3
    index = ChunkIndex(2, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.bfloat16)
    index.add(keys, keys, keys, target_outliers=1)
    copy = ChunkIndex(2, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.bfloat16)
    copy.load(index.state())
    assert torch.equal(copy.landmarks, index.landmarks) and torch.equal(copy.candidates, index.candidates)
    assert list(copy.outliers) == [5] and torch.equal(copy.exact()[1], index.exact()[1])


def test_state_is_views_of_the_index_and_a_load_grows_on():
    """Saving copies nothing (the landmarks of 1M tokens are 1.5 GB); a loaded index keeps growing."""
    keys = smooth_keys(30)
    index = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks", "bounds"}), dtype=torch.float32)
    index.add(keys, keys, keys, target_outliers=0)
    state = index.state()
    storage = index._landmarks.data.untyped_storage().data_ptr()
    for head in range(2):
        view = state[f"landmarks.h{head}"]
        assert view.is_contiguous() and view.untyped_storage().data_ptr() == storage
        assert torch.equal(view, index.landmarks[:, head])
    assert state["lo"].is_contiguous() and state["lo"].data_ptr() == index._lo.data.data_ptr()
    copy = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks", "bounds"}), dtype=torch.float32)
    copy.load({name: t.clone() for name, t in state.items()})
    more = smooth_keys(5, seed=1)
    for grown in (index, copy):
        grown.add(more, more, more, target_outliers=0)
    assert copy.chunks == 35
    assert torch.equal(copy.landmarks, index.landmarks) and torch.equal(copy.hi, index.hi)


def test_the_first_layout_of_landmarks_loads_too():
    keys = smooth_keys(12)
    index = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.float32)
    index.add(keys, keys, keys, target_outliers=0)
    state = {n: t for n, t in index.state().items() if not n.startswith("landmarks.")}
    copy = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.float32)
    copy.load(state | {"landmarks": index.landmarks.contiguous()})      # [n, H, D], one tensor
    assert torch.equal(copy.landmarks, index.landmarks)
    bad = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        bad.load(state | {"landmarks": torch.zeros(12, 3, 16)})
