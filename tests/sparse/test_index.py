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


def test_the_landmark_norm_bound_follows_the_landmarks_through_growth_loads_and_forks():
    def longest(index):
        return index.landmarks.float().norm(dim=-1).amax(dim=0)
    index = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.bfloat16)
    assert torch.equal(index.landmark_norm, torch.zeros(2))
    keys = smooth_keys(40, seed=3)
    index.add(keys[:160], keys[:160], keys[:160], target_outliers=0)
    assert torch.allclose(index.landmark_norm, longest(index))
    keys[200:208] *= 9                                           # a long landmark arrives later
    index.add(keys[160:], keys[160:], keys[160:], target_outliers=0)
    assert torch.allclose(index.landmark_norm, longest(index))
    twin = index.fork()
    twin.add(keys[:8] * 20, keys[:8], keys[:8], target_outliers=0)
    assert torch.allclose(twin.landmark_norm, longest(twin)) and torch.allclose(index.landmark_norm, longest(index))
    copy = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.bfloat16)
    copy.load(twin.state())
    assert torch.allclose(copy.landmark_norm, longest(twin))
    int8 = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.float32,
                      int8_landmarks=True)
    assert int8.landmark_norm is None


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


def test_the_first_branch_to_append_does_so_in_place_and_the_others_copy_first():
    """A stored document's index is shared by the branches forked from it: the first to append after
    the rows written so far appends into the shared storage (no copy of 1.5 GB at 1M tokens), and
    every other writer copies first, so no branch ever sees another's rows."""
    from tierkv.sparse.index import _Growing
    base = _Growing((2,), torch.float32)
    base.extend(torch.arange(20.0).view(10, 2))
    base.resize(16)                                  # room to grow, as a loaded index has
    storage = base.data
    a, b = base.fork(), base.fork()
    a.extend(torch.full((3, 2), -1.0))
    assert a.data is storage and a.rows.shape == (13, 2)             # in place
    b.extend(torch.full((2, 2), -2.0))
    assert b.data is not storage                                     # a wrote past b's rows: b copied
    assert torch.equal(b.rows[10:], torch.full((2, 2), -2.0)) and torch.equal(a.rows[10:], torch.full((3, 2), -1.0))
    assert torch.equal(base.rows, torch.arange(20.0).view(10, 2))
    base.extend(torch.zeros(1, 2))                                   # the base writing later copies too
    assert base.data is not storage and torch.equal(a.rows[10], torch.full((2,), -1.0))
    a2 = a.fork()
    a2.extend(torch.ones(1, 2))                                      # a fork of the writer goes on in place
    a.extend(torch.full((1, 2), 5.0))                                # and then a copies
    assert a2.data is storage and a.data is not storage
    assert a2.rows[13].tolist() == [1.0, 1.0] and a.rows[13].tolist() == [5.0, 5.0]


def test_a_loaded_index_has_room_for_a_branch_to_grow_without_a_copy():
    keys = smooth_keys(40, seed=4)
    index = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.bfloat16)
    index.add(keys[:256], keys[:256], keys[:256], target_outliers=1)
    loaded = ChunkIndex(0, 2, 16, chunk_tokens=8, needs=frozenset({"landmarks"}), dtype=torch.bfloat16)
    loaded.load(index.state())
    storage = loaded._landmarks.data
    branch = loaded.fork()
    branch.add(keys[256:], keys[256:], keys[256:], target_outliers=1)
    assert branch._landmarks.data is storage and branch.chunks == 40 and loaded.chunks == 32
    assert torch.equal(loaded.landmarks, index.landmarks)
    index.add(keys[256:], keys[256:], keys[256:], target_outliers=1)
    assert torch.equal(branch.landmarks, index.landmarks)
