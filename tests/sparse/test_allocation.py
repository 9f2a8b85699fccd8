"""Per-layer decode budgets at an unchanged total (tierkv.sparse.allocation)."""
import math

import pytest
import torch

from tierkv.errors import ConfigError
from tierkv.scoring import landmark_scores
from tierkv.sparse import SparseConfig
from tierkv.sparse.allocation import Allocation, allocate, coverage_curve


def test_with_one_token_chunks_the_estimate_is_the_true_coverage():
    """A 1-token chunk's landmark is its key: the estimated curve is then exact."""
    g = torch.Generator().manual_seed(0)
    Hkv, G, D, C, F = 2, 3, 16, 200, 10
    query, keys, fixed = torch.randn(Hkv * G, D, generator=g), torch.randn(C, Hkv, D, generator=g) * 2, \
        torch.randn(Hkv, F, D, generator=g)
    candidates = torch.ones(C, dtype=torch.bool)
    candidates[::17] = False          # kept exact elsewhere: neither ranked nor counted as chunks here
    curve = coverage_curve(query, fixed, keys, candidates, chunk_tokens=1, grain=5, most=60)

    q = query.view(Hkv, G, D)
    logits = torch.cat([torch.einsum("hgd,chd->hgc", q, keys[candidates]),
                        torch.einsum("hgd,hfd->hgf", q, fixed)], -1) / math.sqrt(D)
    probs = torch.softmax(logits, -1)                                            # [Hkv, G, C' + F]
    order = landmark_scores(query, keys[candidates]).argsort(dim=1, descending=True)   # selector's ranking
    n = int(candidates.sum())
    for i, k in enumerate(range(0, 61, 5)):
        chosen = probs[..., :n].gather(2, order[:, :k].unsqueeze(1).expand(-1, G, -1)).sum(-1)
        truth = (chosen + probs[..., n:].sum(-1)).mean()
        assert curve[i] == pytest.approx(float(truth), abs=1e-5)
    assert torch.all(curve[1:] >= curve[:-1]) and float(curve[-1]) <= 1 + 1e-6


def test_allocation_keeps_the_total_and_gives_to_the_steep_curves():
    flat = torch.linspace(0.9, 0.95, 17)                        # a layer that already has most of its mass
    steep = 1 - 0.8 * torch.exp(-torch.arange(17) / 6.0)         # one that gains with every grain
    uniform = {0: 32, 1: 32, 2: 32}
    chunks = allocate({0: steep, 1: flat, 2: flat}, uniform, grain=8)
    assert sum(chunks.values()) == 96
    assert chunks[0] > 32 > chunks[1] and chunks[1] >= 8 and chunks[2] >= 8      # floors: a quarter
    assert chunks[0] <= 16 * 8                                                    # within its curve


def test_allocation_leaves_unread_what_no_curve_can_use():
    short = torch.tensor([0.5, 0.9, 1.0])                      # ends at 2 grains
    chunks = allocate({0: short, 1: short}, {0: 8, 1: 8}, grain=2)
    assert chunks == {0: 4, 1: 4}


def test_shares_are_re_estimated_every_few_steps():
    """Layer 0 attends evenly over 64 chunks (each more chunk covers more); layer 1's window holds
    nearly all of its attention (more chunks add nothing): the budget moves from 1 to 0."""
    D, C = 8, 64
    query = torch.zeros(1, D)
    query[0, 0] = 4.0
    even = torch.zeros(C, 1, D)
    candidates = torch.ones(C, dtype=torch.bool)
    window = torch.zeros(1, 32, D)
    window[..., 0] = 6.0                                      # q . k / sqrt(D) = 8.5 for every window key
    alloc = Allocation(every=2)
    assert alloc.due() and alloc.share(0) == 1.0
    alloc.offer(0, 8, query, torch.zeros(1, 0, D), even, candidates, chunk_tokens=8)
    alloc.offer(1, 8, query, window, even, candidates, chunk_tokens=8)
    alloc.step_done()
    assert alloc.share(0) > 1 > alloc.share(1) and not alloc.due()
    alloc.step_done()
    assert alloc.due()


def test_an_unknown_allocation_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="allocation='even': allowed: uniform, adaptive"):
        SparseConfig(allocation="even")
    assert SparseConfig().allocation == "uniform"
    assert "allocation" not in dict(SparseConfig(allocation="adaptive").identity())   # decode-only: no new index
