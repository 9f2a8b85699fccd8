"""Weights kept quantized in memory: ``load_model(..., weights="int4")``.

A decode step reads every weight once; on a CPU a bf16 SmolLM2 step spends most of its time in
the matmuls over 257 MiB of weights. llama.cpp reads the GGUF's 4-bit weights as they are. Here
each linear layer of the decoder becomes an ``Int4Linear``: 4-bit values in groups of 32 along the
input, a bf16 scale and offset per group, multiplied by PyTorch's int4 CPU kernel (no full-precision
copy is ever made). The output head becomes an ``Int8Linear``: 8 bits, one scale per output row.

From a Q4_1 GGUF (SmolLM2's) nothing is lost but the scales' precision: Q4_1 stores each group of 32
as ``d * q + m`` with q in 0..15, d and m fp16, and takes m and m + 15 d from the group's min and max,
so quantizing the dequantized weights by each group's min and max finds the same q, d and m again;
d and m are then kept in bf16. From any other model the 4-bit weights are a lossy copy. The
embedding table, norms and biases stay in the model's dtype.

Both kernels take their fast path only for bf16 inputs: given float32 (or float16) rows they run a
reference loop 10-70x slower (a 512-row prefill chunk through one MLP projection: 784 ms against
11 in bf16; one decode row: 1.5 ms against 0.07). So the quantized layers of a model computing in
float32 round their input rows to bf16, run the kernel, and return float32: the products of a
4-bit weight carry its own rounding far above bf16's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from tierkv.errors import ConfigError

WEIGHTS = ("int4",)
GROUP = 32          # inputs per scale and offset
ROWS = 16           # the int4 kernel packs outputs in multiples of this
KERNEL_DTYPE = torch.bfloat16   # what the quantized layers' kernels compute in, whatever the model's dtype
SCHEMES = {"int4": f"int4g{GROUP}h8-bf16"}     # what model_id names: a change of scheme never mixes KV


def packable(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP == 0 and linear.out_features % ROWS == 0


class _QuantizedLinear(nn.Module):
    """What both kinds share: the shapes, the bias in the compute dtype, and a forward over rows."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        out = self._matmul(x.reshape(-1, self.in_features).to(KERNEL_DTYPE)).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _matmul(self, rows: Tensor) -> Tensor:          # rows [M, in] -> [M, out], both in KERNEL_DTYPE
        raise NotImplementedError

    def weight_address(self) -> int:
        """Where the weights lie (a fused projection checks that they were not replaced)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def min_max_groups(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> (q [N, K] int32 in 0..15, d [N, K/GROUP], m [N, K/GROUP]) float32 with each
    group of GROUP inputs ~= d * q + m, m and m + 15 d the group's min and max (Q4_1's own rule)."""
    w = weight.float().reshape(weight.shape[0], -1, GROUP)                             # [N, K/g, g]
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((w - low) / scale).round_().clamp_(0, 15).to(torch.int32).reshape(weight.shape[0], -1)
    return q, scale.squeeze(-1), low.squeeze(-1)


class Int4Linear(_QuantizedLinear):
    """``nn.Linear`` with 4-bit weights in groups of ``GROUP`` inputs (an asymmetric min/max scale)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__(linear, dtype)
        if not packable(linear):
            raise ConfigError(f"int4 weights: a linear layer of {self.in_features} inputs and {self.out_features} "
                              f"outputs; the kernel takes inputs in multiples of {GROUP}, outputs of {ROWS}")
        q, scale, low = min_max_groups(linear.weight.detach())
        # the kernel computes (q - 8) * scale + zero
        scales_zeros = torch.stack([scale, low + 8 * scale], dim=-1)                    # [N, K/g, 2]
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", scales_zeros.transpose(0, 1).contiguous().to(KERNEL_DTYPE))

    def _matmul(self, rows: Tensor) -> Tensor:
        if rows.device.type != "cpu":
            raise ConfigError(f"int4 weights run on the CPU only; this input is on {rows.device}")
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)

    def weight_address(self) -> int:
        return self.packed.data_ptr()

    @classmethod
    def joined(cls, parts: Sequence[Int4Linear]) -> Int4Linear | None:
        """One layer over the same input computing every part's outputs, one part after another (q, k
        and v in one matmul); the parts then hold row slices of its packed values, no second copy.
        The kernel packs a block of output rows together, so this holds only where each part's rows
        fill whole blocks: checked by computing both ways, bit for bit; None where they differ."""
        first = parts[0]
        if any(p.in_features != first.in_features or (p.bias is None) != (first.bias is None) for p in parts):
            return None
        whole = cls.__new__(cls)
        nn.Module.__init__(whole)
        whole.in_features, whole.out_features = first.in_features, sum(p.out_features for p in parts)
        whole.bias = None if first.bias is None else nn.Parameter(torch.cat([p.bias for p in parts]),
                                                                  requires_grad=False)
        whole.register_buffer("packed", torch.cat([p.packed for p in parts]))
        whole.register_buffer("scales_zeros", torch.cat([p.scales_zeros for p in parts], dim=1))
        probe = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(0))
        if not torch.equal(whole(probe), torch.cat([p(probe) for p in parts], dim=-1)):
            return None
        start = 0
        for part in parts:
            part.packed = whole.packed[start:start + part.out_features]    # contiguous rows of the whole
            start += part.out_features
        return whole


class Int8Linear(_QuantizedLinear):
    """``nn.Linear`` with 8-bit weights, one scale per output row (symmetric)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__(linear, dtype)
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("q", (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))

    def _matmul(self, rows: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scale)

    def weight_address(self) -> int:
        return self.q.data_ptr()


def quantize_weights(model: nn.Module, weights: str, dtype: torch.dtype) -> nn.Module:
    """Replace the decoder's linear layers by ``Int4Linear`` (those of shapes the kernel takes: all of
    SmolLM2's, Llama's, Qwen's) and the output head by ``Int8Linear``, quantized from the model's current
    (full-precision) values; the rest is cast to ``dtype``."""
    if weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r}: expected one of {', '.join(WEIGHTS)}")
    for layer in model.model.layers:            # the decoder's layers (arch.decoder_layers, which imports this)
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and packable(child):       # any other stays as it is, in dtype
                    setattr(parent, name, Int4Linear(child, dtype))
    model.lm_head = Int8Linear(model.lm_head, dtype)      # unties it from the embedding, which stays as it is
    model.config.tie_word_embeddings = False
    for param in model.parameters():      # parameters only: buffers such as RoPE's inv_freq stay float32
        param.data = param.data.to(dtype)
    return model


def quantized_params(module: nn.Module) -> int:
    """Weights held by the quantized layers inside ``module`` (buffers, not parameters)."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, _QuantizedLinear))
