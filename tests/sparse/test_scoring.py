import pytest
import torch

import tierkv.scoring
from tierkv.scoring import bound_scores, landmark_scores, quantize_landmarks, top_chunks


def test_landmark_scores_take_the_max_over_each_group():
    g = torch.Generator().manual_seed(1)
    query, landmarks = torch.randn(6, 8, generator=g), torch.randn(10, 2, 8, generator=g)  # G = 3
    scores = landmark_scores(query, landmarks)
    for h in range(2):
        for c in range(10):
            best = max(float(query[h * 3 + j] @ landmarks[c, h]) for j in range(3))
            assert abs(scores[h, c].item() - best) < 1e-5


@pytest.mark.parametrize("chunks", [1, 7, 8, 9, 21])
def test_narrow_landmarks_score_as_their_float32_values_across_blocks(monkeypatch, chunks):
    """bf16 and int8 landmarks, stored head-major as the index keeps them, are widened a block at a time;
    every block, the last one partial, scores what the float32 values of the same landmarks score (up to
    the order of a sum)."""
    monkeypatch.setattr(tierkv.scoring, "BLOCK", 8)
    g = torch.Generator().manual_seed(3)
    query, means = torch.randn(6, 16, generator=g), torch.randn(2, chunks, 16, generator=g).permute(1, 0, 2)
    bf16 = means.to(torch.bfloat16)
    assert torch.allclose(landmark_scores(query, bf16), landmark_scores(query, bf16.float()), atol=1e-5)
    codes, scale = quantize_landmarks(means)
    values = codes.float() * scale.float().unsqueeze(-1)
    assert torch.allclose(landmark_scores(query, codes, scale), landmark_scores(query, values), atol=1e-5)
    assert landmark_scores(query, bf16[:0]).shape == (2, 0)


def test_quest_bound_never_underestimates_the_best_key_in_a_page():
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        keys = torch.randn(12, 8, 2, 16, generator=g) * torch.rand(1, 1, 1, 16, generator=g) * 4  # [C, c, Hkv, D]
        query = torch.randn(4, 16, generator=g)
        bound = bound_scores(query, keys.amin(dim=1), keys.amax(dim=1))                       # [Hkv, C]
        q = query.view(2, 2, 16)
        real = torch.einsum("hgd,cthd->hgct", q, keys).amax(dim=(1, 3))                       # [Hkv, C]
        assert (bound >= real - 1e-4).all()


def test_top_chunks_are_ascending_and_skip_non_candidates():
    scores = torch.tensor([[5.0, 1.0, 9.0, 7.0, 3.0], [0.0, 8.0, 1.0, 2.0, 9.0]])
    assert top_chunks(scores, 2).tolist() == [[2, 3], [1, 4]]
    candidates = torch.tensor([True, True, False, True, True])
    assert top_chunks(scores, 2, candidates).tolist() == [[0, 3], [1, 4]]
    assert top_chunks(scores, 10, candidates).shape == (2, 4)
    assert top_chunks(scores, 0).shape == (2, 0)


@pytest.mark.parametrize("chunks", [0, 1, 9, 21])
def test_the_longest_landmark_is_found_across_blocks(monkeypatch, chunks):
    from tierkv.scoring import longest_landmark
    monkeypatch.setattr(tierkv.scoring, "BLOCK", 8)
    landmarks = torch.randn(3, chunks, 16).permute(1, 0, 2).to(torch.bfloat16)    # head-major, as kept
    want = landmarks.float().norm(dim=-1).amax(dim=0) if chunks else torch.zeros(3)
    assert torch.allclose(longest_landmark(landmarks), want)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_bf16_landmarks_scored_rough_first_pick_the_chunks_exact_scores_pick(query_dtype, monkeypatch):
    """Landmarks that share a large mean key (as real keys do: a score's rounding to bf16 then spans many
    chunks) and a few exact ties: the rough pass in bf16, then the exact rescoring of every chunk the
    rounding could still put in the top k, picks what scoring everything exactly picks, whatever the
    query's dtype (a float32 query is split into a bf16 head and tail); candidates and k past them hold."""
    from tierkv import scoring
    from tierkv.scoring import longest_landmark, top_landmark_chunks
    monkeypatch.setattr(scoring, "TWO_PASS_FROM", 1)    # these 3,000 chunks take the two passes too
    g = torch.Generator().manual_seed(5)
    C, H, G, D = 3000, 3, 3, 64
    common = torch.randn(H, D, generator=g) * 4
    landmarks = (common + torch.randn(C, H, D, generator=g) * 0.3).to(torch.bfloat16)
    landmarks[100:140] = landmarks[7]                               # ties
    candidates = torch.rand(C, generator=g) > 0.05
    norm = longest_landmark(landmarks)
    for trial in range(8):
        query = (torch.randn(H * G, D, generator=g) * 2).to(query_dtype).float()
        for k in (1, 37, 256, C):
            for cand in (None, candidates):
                exact = landmark_scores(query, landmarks)
                want = top_chunks(exact, k, cand)
                got = top_landmark_chunks(query, landmarks, k, cand, norm=norm)
                assert got.shape == want.shape
                masked = exact if cand is None else exact.masked_fill(~cand, float("-inf"))
                # the same chunks, or chunks of exactly the same scores where the k-th is tied
                assert torch.equal(masked.gather(1, got).sort(1).values, masked.gather(1, want).sort(1).values)
    assert top_landmark_chunks(query, landmarks, 0, norm=norm).shape == (H, 0)
    assert top_landmark_chunks(query, landmarks[:0], 5, norm=norm).shape == (H, 0)


def test_landmarks_with_room_to_grow_pick_what_contiguous_ones_pick(monkeypatch):
    """The index keeps landmarks [H, capacity, D] and scores the first C of each head (a narrowed view,
    as after the index grew): the same picks as the same landmarks stored contiguously."""
    from tierkv import scoring
    from tierkv.scoring import longest_landmark, top_landmark_chunks
    monkeypatch.setattr(scoring, "TWO_PASS_FROM", 1)
    g = torch.Generator().manual_seed(8)
    storage = torch.randn(3, 700, 32, generator=g).to(torch.bfloat16)
    grown = storage[:, :500].permute(1, 0, 2)                      # [C, H, D], heads 700 rows apart
    packed = storage[:, :500].contiguous().permute(1, 0, 2)
    query = torch.randn(9, 32, generator=g)
    norm = longest_landmark(packed)
    assert torch.equal(top_landmark_chunks(query, grown, 40, norm=norm), top_landmark_chunks(query, packed, 40, norm=norm))



def test_chunk_rows_of_landmarks_with_room_to_grow_are_those_indexing_gives():
    from tierkv.scoring import chunk_rows
    storage = torch.randn(3, 700, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    grown = storage[:, :500].permute(1, 0, 2)                      # [C, H, D], as the index keeps them
    chunks = torch.tensor([0, 7, 8, 250, 499])
    assert torch.equal(chunk_rows(grown, chunks), grown[chunks])
    assert chunk_rows(grown, chunks[:0]).shape == (0, 3, 32)


@pytest.mark.parametrize("k", [0, 1, 7, 63, 64])
def test_top_indices_are_each_rows_k_best_ascending(k):
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(3, 64, generator=g)
    scores[1, ::5] = scores[1, 3]                       # ties, some at the cut
    scores[2, 10:20] = float("inf")                     # a head's own chunks, kept whatever k
    got = tierkv.scoring.top_indices(scores, k)
    assert got.shape == (3, k) and got.dtype == torch.long and got.is_contiguous()
    assert torch.equal(got, got.sort(dim=1).values)
    for h in range(3):
        chosen = torch.zeros(64, dtype=torch.bool)
        chosen[got[h]] = True
        assert int(chosen.sum()) == k                   # k distinct indices
        if 0 < k < 64:                                  # nothing left out scores above what was taken
            assert scores[h][~chosen].max() <= scores[h][chosen].min()
    reference = scores.topk(k, dim=1).indices.sort(dim=1).values
    assert torch.equal(got[0], reference[0])            # no ties in row 0: the very same chunks
