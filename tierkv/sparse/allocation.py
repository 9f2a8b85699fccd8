"""Per-layer decode budgets at an unchanged total: give the tokens to the layers that need them.

Layers differ in how widely they attend. Measured on SmolLM2 with a 16K document and 2048 tokens
per KV head in every layer, the selection covers 57 % of layer 0's attention and over 99 % of
layer 10's: the same budget is too little for one and more than enough for the other. Ada-KV and
PyramidKV move budget between heads or layers for that reason; here the move is estimated from
what sparse decode already holds, with no dense attention::

    per layer, at one decode step (its own query q, per query head):
        fixed   sinks + window + exact outliers: exact keys, log-mass lse(q . k / sqrt(D))
        chunk   c: log-mass ~ log(chunk_tokens) + q . landmark_c / sqrt(D)   (first order)
        curve   r(k) = (fixed + the k chunks the selector ranks first) / (fixed + every chunk),
                mean over query heads: the share of attention k chunks would cover
    allocate    the layers' chunks, summed as a uniform budget would give them, go out in grains
                to the layer whose curve gains most from one more grain (greedy on the marginal
                gain), each layer between a quarter and four times its uniform share

The shares are re-estimated every ``every`` decode steps (attention moves slowly from one token to
the next) and scale the configured budget, so a budget given as a share of the context still
grows with it. Layers with their own budget (``SparseConfig.layer_budgets``) keep it and take no
part. Measured offline on SmolLM2's 16K document (dense queries of 16 steps, 2048 tokens per layer
on average): the same budget everywhere covers 0.962 of the attention, this allocation 0.976, and
the same greedy allocation from the true curves 0.978.

It is not the default (``SparseConfig.allocation="uniform"``): in the engine, on the 8K document
over 256 teacher-forced steps, it raised the mean coverage only from 0.963 to 0.966 and lowered
top-1 agreement with dense from 0.902 to 0.871 (KL 0.102 -> 0.157 nats). Layers 3-9 attend to a
few tokens that chunk means hide; their landmarks make them look well covered, so they give up
budget they need, while layer 0's diffuse attention gains coverage that barely moves its output.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def coverage_curve(query: Tensor, fixed_keys: Tensor, landmarks: Tensor, candidates: Tensor, *,
                   chunk_tokens: int, grain: int, most: int) -> Tensor:
    """Estimated share of the attention covered with the top ``0, grain, 2*grain, ... <= most`` chunks.

    query [Hq, D] and the keys in the frame the landmarks were built in; fixed_keys [Hkv, F, D]
    are always attended; landmarks [C, Hkv, D]; candidates [C] bool (False: kept exact, counted
    in ``fixed_keys``). The chunks rank as the landmark selector ranks them: per KV head by the
    max over its query heads of q . landmark.
    """
    C, Hkv, D = landmarks.shape
    q = query.reshape(Hkv, -1, D).float() / math.sqrt(D)                          # [Hkv, G, D]
    chunk = torch.bmm(q, landmarks.permute(1, 0, 2).float().transpose(1, 2))    # [Hkv, G, C]
    chunk = chunk.masked_fill(~candidates.view(1, 1, -1), float("-inf")) + math.log(chunk_tokens)
    fixed = torch.logsumexp(torch.bmm(q, fixed_keys.float().transpose(1, 2)), dim=-1) \
        if fixed_keys.shape[1] else torch.full(q.shape[:2], float("-inf"))      # [Hkv, G]
    total = torch.logaddexp(fixed, torch.logsumexp(chunk, dim=-1))              # [Hkv, G]
    k = min(most, int(candidates.sum()))
    first = chunk.amax(dim=1).topk(k, dim=1).indices                            # [Hkv, k], best first
    shares = (chunk.gather(2, first.unsqueeze(1).expand(-1, q.shape[1], -1)) - total.unsqueeze(-1)).exp()
    covered = torch.cat([torch.zeros_like(shares[..., :1]), shares.cumsum(-1)], dim=-1)   # [Hkv, G, k+1]
    covered = covered + (fixed - total).exp().unsqueeze(-1)
    steps = torch.arange(0, most + 1, grain).clamp(max=k)
    return covered[..., steps].mean(dim=(0, 1))                                 # [most // grain + 1]


def allocate(curves: dict[int, Tensor], uniform: dict[int, int], *, grain: int) -> dict[int, int]:
    """Chunks per layer: at most as many in all as ``uniform`` gives, each layer from a quarter of
    its uniform share to the end of its curve, every grain where the estimated coverage rises most
    (curves sampled every ``grain`` chunks, as `coverage_curve` returns them)."""
    chunks = {layer: uniform[layer] // 4 // grain * grain for layer in curves}
    left = sum(uniform[layer] for layer in curves) - sum(chunks.values())

    def gain(layer: int) -> float:
        at, curve = chunks[layer] // grain, curves[layer]
        return float(curve[at + 1] - curve[at]) if at + 1 < len(curve) else -1.0
    heap = [(-gain(layer), layer) for layer in curves]
    heapq.heapify(heap)
    while left >= grain and heap:
        neg, layer = heapq.heappop(heap)
        if neg > 0:                       # every curve has ended: the rest of the budget stays unread
            break
        chunks[layer] += grain
        left -= grain
        heapq.heappush(heap, (-gain(layer), layer))
    return chunks


@dataclass(slots=True)
class Allocation:
    """One sequence's decode budgets per layer, as shares of the configured budget (1.0: uniform).

    During a step where ``due()`` the engine hands each layer's estimate to ``offer``;
    ``step_done()`` shares the budget anew from them."""

    every: int = 32                              # decode steps between estimates
    shares: dict[int, float] = field(default_factory=dict)
    steps: int = 0
    curves: dict[int, Tensor] = field(default_factory=dict)
    uniform: dict[int, int] = field(default_factory=dict)

    def due(self) -> bool:
        return self.steps % self.every == 0

    def share(self, layer: int) -> float:
        return self.shares.get(layer, 1.0)

    def offer(self, layer: int, uniform_chunks: int, query: Tensor, fixed_keys: Tensor, landmarks: Tensor,
              candidates: Tensor, *, chunk_tokens: int) -> None:
        """``layer``'s coverage curve (see `coverage_curve`) at ``uniform_chunks``, its uniform share."""
        self.curves[layer] = coverage_curve(query, fixed_keys, landmarks, candidates, chunk_tokens=chunk_tokens,
                                            grain=_grain(uniform_chunks), most=4 * uniform_chunks)
        self.uniform[layer] = uniform_chunks

    def step_done(self) -> None:
        if self.curves:
            # every offering layer has the configured budget (pinned layers do not offer): one grain
            chunks = allocate(self.curves, self.uniform, grain=_grain(max(self.uniform.values())))
            self.shares = {layer: n / self.uniform[layer] for layer, n in chunks.items()}
            self.curves, self.uniform = {}, {}
        self.steps += 1


def _grain(uniform_chunks: int) -> int:
    """Chunks moved at a time: a sixteenth of the uniform share."""
    return max(1, uniform_chunks // 16)
