"""Tiny Llama-shaped random models for the schedule tests (made here; nothing is downloaded)."""
from __future__ import annotations

import torch

from tierkv.model.arch import model_spec
from tierkv.model.loading import LoadedModel


def tiny_llama(seed: int = 0, *, layers: int = 3, vocab: int = 256, dtype: torch.dtype = torch.float32):
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    return model.eval().requires_grad_(False)


def loaded_tiny(seed: int = 0, **kw) -> LoadedModel:
    model = tiny_llama(seed, **kw)
    return LoadedModel(model, None, f"tiny-llama-{seed}", model_spec(model))


def random_prompts(n: int, lo: int, hi: int, vocab: int = 256, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy decoding of one prompt, no padding, no early stop."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
