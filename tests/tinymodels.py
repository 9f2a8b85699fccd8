"""Helpers of the model tests: tiny random models of each family, and the native forward pass."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from tierkv.model import arch
from tierkv.ops.attention import attend, merge

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
            initializer_range=0.2)  # large init so attention is far from uniform
KINDS = ("llama", "llama-yarn", "mistral", "qwen2", "qwen3")


def tiny_config(kind: str):
    """Small configs of each supported family (and a scaled-RoPE variant); nothing is downloaded."""
    import transformers

    configs = {
        "llama": lambda: transformers.LlamaConfig(**TINY),
        "llama-yarn": lambda: transformers.LlamaConfig(**TINY, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64}),
        "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**TINY),                  # q/k/v with bias
        "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32),     # q/k norm; H*D != hidden
    }
    return configs[kind]()


def tiny_model(kind: str, seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    return model.eval().requires_grad_(False)


def native_logits(model: nn.Module, ids: Tensor, *, chunk: int, block: int) -> Tensor:
    """Full forward without transformers' attention or cache.

    Query chunks of ``chunk`` tokens attend to key blocks of ``block`` tokens (merged online
    softmax), so blocks before, overlapping and inside a chunk all occur.
    """
    T = ids.shape[1]
    cos, sin = arch.rope_cos_sin(model, torch.arange(T))                  # [1, T, D]
    h = arch.embed(model, ids)                                            # [B, T, hidden]
    for layer in arch.decoder_layers(model):
        q, _, k, v = arch.project_qkv(layer, h, cos, sin)
        outs = []
        for c in range(0, T, chunk):
            qc = q[:, :, c:c + chunk]
            parts = [attend(qc, k[:, :, s:s + block], v[:, :, s:s + block], causal=True, q_offset=c - s)
                     for s in range(0, min(T, c + chunk), block)]
            outs.append(merge(parts))
        h = arch.mlp_block(layer, arch.finish_attention(layer, torch.cat(outs, dim=2), h))
    return arch.final_logits(model, h)
