"""Fixtures of the server tests: servers started per test, and a tiny model with SmolLM2's tokenizer.

The tiny model (random weights, a 512-token trained window) makes "a document past the trained
window" a 1.5K-token one, so the sparse path runs through the server in seconds.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import API_KEY, Server, start_server


@pytest.fixture
def launch(tmp_path) -> Iterator:
    started: list[Server] = []

    def run(*args: str, key: str | None = API_KEY) -> Server:
        started.append(start_server(tmp_path, *args, key=key))
        return started[-1]
    yield run
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2) -> Path:
    """A random Llama of 2 layers with SmolLM2's tokenizer and chat template, trained window 512."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tiny-window")
    tokenizer = smollm2.tokenizer
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                      max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
