"""A page: the read unit of sparse decode, values and key factors of ``page_tokens`` tokens.

Selection picks 8-token chunks, but a read that small wastes the device
(O_DIRECT wants 4 KiB multiples; SmolLM2's values are 384 B per token in
bf16). A page groups whole chunks of one layer, values and low-rank key
factors together, so one read brings everything needed to rebuild and
attend to them::

    page p of layer l  = tokens [sinks + p*P, sinks + (p+1)*P)
    bytes              = V [P, Hkv, D] | A [P, r] | zero padding to a multiple of 4096

SmolLM2, bf16, P = 16, r = 192 (full): 6 KiB of values + 6 KiB of factors -> 12 KiB.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tierkv.device import align_up



@dataclass(frozen=True, slots=True)
class PageLayout:
    page_tokens: int
    num_kv_heads: int
    head_dim: int
    rank: int
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def value_bytes(self) -> int:
        return self.page_tokens * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def payload_bytes(self) -> int:
        return self.value_bytes + self.page_tokens * self.rank * self.itemsize

    @property
    def page_bytes(self) -> int:
        return align_up(self.payload_bytes)

    @property
    def name(self) -> str:
        return (f"sparse-P{self.page_tokens}-H{self.num_kv_heads}-D{self.head_dim}-R{self.rank}"
                f"-{str(self.dtype).removeprefix('torch.')}")

    def pack(self, values: Tensor, factors: Tensor) -> Tensor:
        """values [P, Hkv, D], factors [P, r] -> uint8 [page_bytes]."""
        raw = torch.zeros(self.page_bytes, dtype=torch.uint8)
        vb = self.value_bytes
        raw[:vb] = values.to(self.dtype).contiguous().view(-1).view(torch.uint8)
        raw[vb:self.payload_bytes] = factors.to(self.dtype).contiguous().view(-1).view(torch.uint8)
        return raw

    def unpack(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        """uint8 [n, page_bytes] -> (values [n, P, Hkv, D], factors [n, P, r]), views into ``raw``."""
        n, vb = raw.shape[0], self.value_bytes
        values = raw[:, :vb].view(self.dtype).view(n, self.page_tokens, self.num_kv_heads, self.head_dim)
        factors = raw[:, vb:self.payload_bytes].view(self.dtype).view(n, self.page_tokens, self.rank)
        return values, factors
