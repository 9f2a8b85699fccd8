import torch

from tierkv.sparse.lowrank import KeyBasis, project, reconstruct


def low_rank_keys(n=600, heads=2, dim=16, rank=5, noise=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, rank, generator=g) @ torch.randn(rank, heads * dim, generator=g)
    return (keys + noise * torch.randn(n, heads * dim, generator=g)).view(n, heads, dim)


def test_full_rank_rebuilds_the_keys_exactly():
    keys = torch.randn(300, 2, 16)
    basis = KeyBasis(32)
    basis.add(keys)
    B = basis.fit(32)
    assert torch.allclose(reconstruct(project(keys, B), B, 2), keys, atol=1e-4)


def test_streaming_gram_finds_the_same_subspace_as_one_svd():
    keys = low_rank_keys(noise=0.01)
    streamed = KeyBasis(32)
    for part in keys.split(77):                       # uneven chunks
        streamed.add(part)
    B = streamed.fit(5)
    _, _, vh = torch.linalg.svd(keys.reshape(600, -1), full_matrices=False)
    # same span: projecting one basis on the other keeps all its energy
    assert torch.allclose((vh[:5] @ B.T).norm(dim=1), torch.ones(5), atol=1e-3)
    assert streamed.energy_kept > 0.999


def test_rank_below_the_keys_loses_what_the_energy_says():
    keys = low_rank_keys(rank=8)
    basis = KeyBasis(32)
    basis.add(keys)
    B = basis.fit(4)
    rebuilt = reconstruct(project(keys, B), B, 2)
    lost = ((keys - rebuilt).norm() ** 2 / keys.norm() ** 2).item()
    assert abs(lost - (1 - basis.energy_kept)) < 1e-3
    assert lost > 0.01
