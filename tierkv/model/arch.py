"""The one model-specific place: pure tensor functions over a transformers Llama-family decoder.

Supported: Llama (and SmolLM), Mistral, Qwen2, Qwen3. They share one decoder layer::

    h = embed(ids)
    per layer:  x = input_layernorm(h)
                q, k, v = q_proj(x), k_proj(x), v_proj(x)       (+ q_norm/k_norm per head: Qwen3)
                q, k = rope(q), rope(k)
                h = h + o_proj(attention(q, k, v))
                h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))

These functions run one decoder step without transformers' cache or attention code, so the
native loop can hold K/V itself. Shapes: ``B`` batch, ``T`` tokens, ``H``/``Hkv`` query/KV heads,
``D`` head dim. Differences between the architectures stay in this file.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tierkv.device import native_bf16
from tierkv.errors import ConfigError
from tierkv.model.weights import Int4Linear, quantized_params
from tierkv.ops.rope import apply_rope

# transformers `model_type` -> what it is; every one runs through the functions below.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama, SmolLM",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3 (per-head q/k RMSNorm before RoPE)",
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a loaded model: what the KV layout and the native loop need to know."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    rope_theta: float
    max_position: int
    dtype: torch.dtype
    sliding_window: int | None = None  # the native loop attends to all keys; None = no window

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads}: must be a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at ``dtype``."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def check_architecture(model_type: str | None, *, source: str = "model") -> None:
    """Raise ConfigError unless ``model_type`` (a config's or a GGUF's) is supported."""
    if model_type not in SUPPORTED_ARCHITECTURES:
        listed = ", ".join(f"{name} ({what})" for name, what in SUPPORTED_ARCHITECTURES.items())
        raise ConfigError(f"{source}: architecture {model_type!r} is not supported; supported: {listed}")


def model_spec(model: nn.Module) -> ModelSpec:
    config = model.config
    check_architecture(config.model_type)
    rope = getattr(config, "rope_parameters", None) or {}
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        max_position=config.max_position_embeddings,
        dtype=model.dtype,
        sliding_window=getattr(config, "sliding_window", None),
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (quantized weights are buffers), each once: tied
    weights are not counted twice."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def embed(model: nn.Module, ids: Tensor) -> Tensor:
    """ids [B, T] -> h [B, T, hidden]."""
    return model.model.embed_tokens(ids)


def rope_cos_sin(model: nn.Module, positions: Tensor) -> tuple[Tensor, Tensor]:
    """positions [T] or [B, T] -> (cos, sin) [B, T, D] in the model's dtype.

    Uses the model's own rotary embedding, so scaled variants (linear, yarn, llama3, ...) match.
    """
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    probe = torch.empty(0, dtype=model.dtype, device=positions.device)  # only dtype/device matter
    return model.model.rotary_emb(probe, positions)


def project_qkv(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Residual stream h [B, T, hidden] -> (q, k_pre, k, v).

    q [B, H, T, D] and k [B, Hkv, T, D] are post-RoPE; k_pre is k before RoPE (after Qwen3's
    k_norm, as in transformers); v [B, Hkv, T, D].
    """
    q_pre, k_pre, v = project_qkv_pre(layer, h)
    return apply_rope(q_pre, cos, sin), k_pre, apply_rope(k_pre, cos, sin), v


def project_qkv_pre(layer: nn.Module, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """h [B, T, hidden] -> (q_pre [B, H, T, D], k_pre [B, Hkv, T, D], v [B, Hkv, T, D]), before RoPE."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)                                   # [B, T, hidden]
    B, T, _ = x.shape
    q, k, v = _fused(attn, x) or (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    q = q.view(B, T, -1, attn.head_dim)                            # [B, T, H, D]
    k = k.view(B, T, -1, attn.head_dim)                            # [B, T, Hkv, D]
    v = v.view(B, T, -1, attn.head_dim)                            # [B, T, Hkv, D]
    if hasattr(attn, "q_norm"):                                    # Qwen3: RMSNorm per head
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def project_query_pre(layer: nn.Module, h: Tensor) -> Tensor:
    """h [B, T, hidden] -> q_pre [B, H, T, D]: the query alone (a speculative guess costs only this)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    return q.transpose(1, 2)


def finish_attention(layer: nn.Module, attn_out: Tensor, residual: Tensor) -> Tensor:
    """attn_out [B, H, T, D], residual [B, T, hidden] -> h [B, T, hidden] (o_proj + residual)."""
    B, H, T, D = attn_out.shape
    merged = attn_out.transpose(1, 2).reshape(B, T, H * D)         # [B, T, H*D]
    return residual + _linear(layer.self_attn.o_proj, merged)


def mlp_block(layer: nn.Module, h: Tensor) -> Tensor:
    """h [B, T, hidden] -> h + mlp(post_attention_layernorm(h))."""
    mlp, x = layer.mlp, layer.post_attention_layernorm(h)
    gate_up = _fused(mlp, x)
    if gate_up is None:
        return h + mlp(x)
    gate, up = gate_up
    return h + _linear(mlp.down_proj, mlp.act_fn(gate) * up)


# -- fused projections -------------------------------------------------------------------------
FUSED = "tierkv_fused"     # the module attribute holding a `Fused`


@dataclass(frozen=True, slots=True)
class Fused:
    weight: Tensor | None               # [sum of outputs, in]: the projections' weights, one after another
    bias: Tensor | None
    sizes: list[int]                    # each projection's outputs
    parts: tuple[tuple[str, nn.Module, int, int], ...]  # (name, module, weight and bias addresses) when fused
    joined: nn.Module | None = None     # quantized projections: one layer computing them all (weight None)


def fuse_projections(model: nn.Module) -> nn.Module:
    """One matmul where a layer has several over the same input: q, k and v, and gate and up. Their
    weights become row slices of one tensor per layer; transformers' modules hold those slices (the same
    values in the same [out, in] layout, no second copy), so its own forward is unchanged, and the
    functions above run one matmul while the modules still hold the slices. Fewer, larger matmuls over
    weights that do not fit a cache: the linear layers of a SmolLM2 decode step on 2 cores take 17 ms
    instead of 26 in bf16 (`bench/RESULTS.md`). 4-bit projections are joined the same way
    (``Int4Linear.joined``: the modules hold row slices of one packed tensor); any other module (8-bit,
    adapted) is left as it is."""
    for layer in decoder_layers(model):
        _fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        _fuse(layer.mlp, ("gate_proj", "up_proj"))
    return model


def _fuse(module: nn.Module, names: tuple[str, ...]) -> None:
    linears = [getattr(module, name, None) for name in names]
    if all(type(linear) is Int4Linear for linear in linears):
        joined = Int4Linear.joined(linears)
        if joined is not None:
            parts = tuple((name, linear, linear.weight_address(), _address(linear.bias))
                          for name, linear in zip(names, linears))
            module.__dict__[FUSED] = Fused(None, None, [linear.out_features for linear in linears], parts, joined)
        return
    if not all(type(linear) is nn.Linear for linear in linears):
        return
    biases = [linear.bias for linear in linears]
    if any(b is None for b in biases) != all(b is None for b in biases):
        return
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    start, parts = 0, []
    for name, linear in zip(names, linears):
        rows = slice(start, start + linear.out_features)
        linear.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[rows], requires_grad=False)
        parts.append((name, linear, linear.weight.data_ptr(), _address(linear.bias)))
        start = rows.stop
    module.__dict__[FUSED] = Fused(weight, bias, [linear.out_features for linear in linears], tuple(parts))


def _fused(module: nn.Module, x: Tensor) -> tuple[Tensor, ...] | None:
    """The outputs of ``module``'s fused projections of ``x``, or None when it has none or one of their
    parameters was replaced since (then each projection runs on its own)."""
    fused = module.__dict__.get(FUSED)
    if fused is None:
        return None
    modules = module._modules
    for name, linear, weight, bias in fused.parts:    # (~1 us each: plain dict lookups, not nn.Module's)
        params = linear._parameters
        now = params["weight"].data_ptr() if fused.joined is None else linear.weight_address()
        if modules[name] is not linear or now != weight or _address(params.get("bias")) != bias:
            return None
    if fused.joined is not None:
        return fused.joined(x).split(fused.sizes, dim=-1)
    packed = module.__dict__.get(PACKED)
    if packed is not None and x.numel() == x.shape[-1]:
        return packed(x).split(fused.sizes, dim=-1)
    return torch.nn.functional.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)


def _address(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


# -- weights packed for decode rows ------------------------------------------------------------------
PACKED = "tierkv_packed"            # the module attribute holding a `Packed`
PACKED_ENV = "TIERKV_PACKED_WEIGHTS"   # "0": decode rows through the plain weights


@dataclass(frozen=True, slots=True)
class Packed:
    """A bf16 weight laid out once for oneDNN's products (``mkldnn._reorder_linear_weight``), for rows
    one at a time: PyTorch's ``linear`` lays the weight out again at every call."""

    weight: Tensor                      # oneDNN's layout
    bias: Tensor | None
    source: int                         # the address of the weight packed

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor | None) -> Packed:
        weight = weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        return cls(packed, None if bias is None else bias.detach(), weight.data_ptr())

    def __call__(self, x: Tensor) -> Tensor:
        """``linear(x, weight, bias)`` of a single row x [..., in]."""
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(1, -1), self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], -1)


def packs_weights(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether `pack_decode_weights` packs a model in ``dtype`` on ``device``: bf16 on a CPU that computes it
    natively (AMX or AVX512-BF16), with oneDNN, unless ``TIERKV_PACKED_WEIGHTS=0``. Where bf16 is emulated
    nothing is packed: ``--dtype auto`` computes in float32 there."""
    setting = os.environ.get(PACKED_ENV, "1")
    if setting not in ("0", "1"):
        raise ConfigError(f"{PACKED_ENV}={setting!r}: 0 (decode through the plain weights) or 1 (packed where "
                          "the CPU computes bf16 natively, the default)")
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and setting == "1"
            and native_bf16() in ("AMX", "AVX512-BF16") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_decode_weights(model: nn.Module) -> nn.Module:
    """A copy of every bf16 projection of a decode step laid out for oneDNN (the fused q/k/v and
    gate/up weights, o_proj, down_proj, the output head), used for single rows: a decode step's
    products. A 32K sparse step's took ~5 ms less on an AMX Xeon and ~13 ms less on an AVX512-BF16 EPYC,
    with the same bits as ``linear``'s (tests/model/test_model_arch.py checks them where it runs). Rows in
    batches (a prefill chunk) keep ``linear``, which rounds differently there and is as fast. The copies
    cost the weights' bytes once more (~270 MB for SmolLM2); where `packs_weights` is False nothing is
    packed."""
    first = next(model.parameters(), None)
    if first is None or not packs_weights(first.dtype, first.device):
        return model
    for layer in decoder_layers(model):
        for module in (layer.self_attn, layer.mlp):
            fused = module.__dict__.get(FUSED)
            if fused is not None and fused.weight is not None and fused.weight.dtype == torch.bfloat16:
                module.__dict__[PACKED] = Packed.of(fused.weight, fused.bias)
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            _pack(linear)
    _pack(model.lm_head)
    return model


def _pack(linear: nn.Module) -> None:
    if type(linear) is nn.Linear and linear.weight.dtype == torch.bfloat16:
        linear.__dict__[PACKED] = Packed.of(linear.weight, linear.bias)


def _linear(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``, through its packed weight where x is one row and the module still holds the weight
    that was packed."""
    packed = module.__dict__.get(PACKED)
    if packed is not None and x.numel() == x.shape[-1]:
        params = module._parameters
        if params["weight"].data_ptr() == packed.source and _address(params.get("bias")) == _address(packed.bias):
            return packed(x)
    return module(x)


def final_logits(model: nn.Module, h: Tensor) -> Tensor:
    """h [B, T, hidden] -> logits [B, T, vocab] (final norm + lm_head)."""
    return _linear(model.lm_head, model.model.norm(h))


def recompute_seconds(model: nn.Module, tokens: int, *, repeats: int = 3) -> float:
    """Seconds one decoder layer takes to compute ``tokens`` tokens again on this machine, from its
    weights' FLOPs (2 per parameter and token) at a matrix multiply rate measured here now (the best of
    ``repeats``). Attention over earlier tokens is left out: a lower bound, so a remote read has to beat
    the cheapest recompute."""
    layer = decoder_layers(model)[0]
    params = sum(p.numel() for p in layer.parameters()) + quantized_params(layer)   # 4-bit weights are buffers
    weight = next(layer.parameters())
    width = model.config.hidden_size
    a = torch.randn(512, width, dtype=weight.dtype, device=weight.device)
    b = torch.randn(width, 4 * width, dtype=weight.dtype, device=weight.device)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        a @ b
        if a.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    rate = 2 * a.shape[0] * width * b.shape[1] / best
    return 2 * params * tokens / rate
