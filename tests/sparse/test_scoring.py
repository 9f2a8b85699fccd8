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
