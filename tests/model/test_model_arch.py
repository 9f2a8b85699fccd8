"""The native forward (arch + attend/merge) against transformers' own forward."""
from __future__ import annotations

import pytest
import torch
from tinymodels import KINDS, native_logits, tiny_model

from tierkv.errors import ConfigError
from tierkv.model import arch
from tierkv.ops import rope

PROMPT = ("The tiered cache keeps hot keys and values in fast memory and moves cold blocks to "
          "pinned host memory or to disk. ") * 12


@pytest.mark.parametrize("kind", KINDS)
def test_native_forward_matches_transformers(kind):
    model = tiny_model(kind)
    ids = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        got = native_logits(model, ids, chunk=48, block=32)
    assert want.abs().max() > 1.0            # random logits far from zero: the check has teeth
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_unrope_inverts_apply_rope(kind):
    model = tiny_model(kind)
    cos, sin = arch.rope_cos_sin(model, torch.arange(1000, 1300))        # [1, T, D]
    k = torch.randn(1, 2, 300, cos.shape[-1])
    rotated = rope.apply_rope(k, cos, sin)
    assert not torch.allclose(rotated, k, atol=1e-2)
    torch.testing.assert_close(rope.unrope(rotated, cos, sin), k, atol=2e-5, rtol=1e-5)


def test_apply_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama-yarn")
    cos, sin = arch.rope_cos_sin(model, torch.arange(20).expand(2, 20))
    q, k = torch.randn(2, 4, 20, 16), torch.randn(2, 2, 20, 16)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(rope.apply_rope(q, cos, sin), want_q)
    assert torch.equal(rope.apply_rope(k, cos, sin), want_k)


def test_a_rope_table_spans_positions_in_the_dtype_asked_and_rotates_bf16_keys_as_the_model_does():
    """A span in bf16 is the float32 table's rows rounded (a copy made once, remade when the table
    grows); bf16 keys rotated by it match transformers' own bf16 rotation (cos and sin cast to the
    keys' dtype, as its rotary embedding returns them)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    model = tiny_model("llama")
    table = rope.RopeTable(lambda p: arch.rope_cos_sin(model, p.unsqueeze(0)), 16)
    cos, sin = table.span(3, 40)
    cos16, sin16 = table.span(3, 40, torch.bfloat16)
    assert cos16.dtype == torch.bfloat16 and torch.equal(cos16, cos.bfloat16()) and torch.equal(sin16, sin.bfloat16())
    far = table.span(5000, 8, torch.bfloat16)[0]                      # grows the table: the copy follows
    assert torch.equal(far, table.span(5000, 8)[0].bfloat16())
    at = torch.tensor([[7, 4999], [0, 12]])
    assert torch.equal(table.at(at, torch.bfloat16)[1], table.at(at)[1].bfloat16())
    assert table.rotate_heads(torch.randn(2, 2, 16).bfloat16(), at).dtype == torch.bfloat16
    k = torch.randn(1, 2, 40, 16).bfloat16()
    q = torch.randn(1, 4, 40, 16).bfloat16()
    assert torch.equal(rope.apply_rope(k, cos16, sin16), apply_rotary_pos_emb(q, k, cos16, sin16)[1])


def test_a_fused_span_rotation_is_apply_rope_rounded_once_and_follows_the_table_as_it_grows():
    model = tiny_model("llama")
    table = rope.RopeTable(lambda p: arch.rope_cos_sin(model, p.unsqueeze(0)), 16)
    k = torch.randn(1, 2, 40, 16)
    for start in (0, 3, 6000):                                         # 6000 grows the table
        cos, sin = table.span(start, 40)
        exact = rope.apply_rope(k, cos, sin)
        assert torch.allclose(table.rotate_span(k, start), exact, atol=1e-5)
        fused16 = table.rotate_span(k.bfloat16(), start)
        assert fused16.dtype == torch.bfloat16
        assert (fused16.float() - exact).abs().max() <= 2 ** -7 * exact.abs().max()   # bf16 rounding
    assert torch.allclose(rope.unrope(table.rotate_span(k, 9), *table.span(9, 40)), k, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_k_pre_is_k_before_rope(kind):
    model = tiny_model(kind)
    layer = arch.decoder_layers(model)[1]
    h = torch.randn(1, 12, model.config.hidden_size)
    cos, sin = arch.rope_cos_sin(model, torch.arange(12))
    q, k_pre, k, v = arch.project_qkv(layer, h, cos, sin)
    attn = layer.self_attn
    raw = attn.k_proj(layer.input_layernorm(h)).view(1, 12, 2, attn.head_dim)
    if kind == "qwen3":
        raw = attn.k_norm(raw)               # transformers normalises per head before RoPE
    assert q.shape == (1, 4, 12, attn.head_dim) and v.shape == k.shape == (1, 2, 12, attn.head_dim)
    torch.testing.assert_close(k_pre, raw.transpose(1, 2))
    torch.testing.assert_close(rope.unrope(k, cos, sin), k_pre, atol=1e-5, rtol=1e-5)


def test_spec_of_tiny_qwen3():
    spec = arch.model_spec(tiny_model("qwen3"))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden) == (2, 4, 2, 32, 64)
    assert spec.group == 2 and spec.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4


@pytest.mark.model
def test_smollm2_native_forward_matches_transformers(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert 250 <= ids.shape[1] <= 400
    with torch.inference_mode():
        want = model(ids).logits
        got = native_logits(model, ids, chunk=128, block=64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())


@pytest.mark.parametrize("kind", KINDS)
def test_fused_projections_keep_both_forwards_and_share_the_weights(kind):
    model = tiny_model(kind)
    ids = torch.randint(0, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want, native = model(ids).logits, native_logits(model, ids, chunk=48, block=32)
    params = sum(p.numel() for p in model.parameters())
    arch.fuse_projections(model)
    attn, mlp = arch.decoder_layers(model)[0].self_attn, arch.decoder_layers(model)[0].mlp
    fused = attn.__dict__[arch.FUSED]
    assert fused.weight.shape[0] == sum(fused.sizes) == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    assert attn.k_proj.weight.data_ptr() == fused.weight[attn.q_proj.out_features].data_ptr()   # a view, no copy
    assert arch.FUSED in mlp.__dict__ and sum(p.numel() for p in model.parameters()) == params
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)            # transformers' forward: bit for bit as before
        x = torch.randn(1, 5, model.config.hidden_size)
        q, k, v = arch._fused(attn, x)                          # the fused path is the one that runs
        torch.testing.assert_close(k, attn.k_proj(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(native_logits(model, ids, chunk=48, block=32), native, atol=1e-5, rtol=1e-5)
        attn.v_proj.weight = torch.nn.Parameter(torch.zeros_like(attn.v_proj.weight))   # replaced after fusing
        assert arch._fused(attn, x) is None                     # each projection runs on its own again
        assert not arch.project_qkv_pre(arch.decoder_layers(model)[0], x)[2].any()   # the new (zero) weights


def test_weights_are_packed_only_for_bf16_on_a_cpu_that_computes_it(monkeypatch):
    assert not arch.packs_weights(torch.float32) and not arch.packs_weights(torch.float16)
    monkeypatch.setenv(arch.PACKED_ENV, "0")
    assert not arch.packs_weights(torch.bfloat16)
    model = arch.fuse_projections(tiny_model("llama").to(torch.bfloat16))
    arch.pack_decode_weights(model)
    assert not any(arch.PACKED in m.__dict__ for m in model.modules())
    monkeypatch.setenv(arch.PACKED_ENV, "yes")                  # taken as on, where only "0" was off
    with pytest.raises(ConfigError, match="TIERKV_PACKED_WEIGHTS='yes': 0 .* or 1"):
        arch.packs_weights(torch.bfloat16)


@pytest.mark.skipif(not arch.packs_weights(torch.bfloat16),
                    reason="bf16 weights are packed on a CPU with AMX or AVX512-BF16, with oneDNN, only")
def test_packed_weights_give_linear_bits_for_one_row_and_step_aside_otherwise(monkeypatch):
    """A decode row goes through the packed copies with the bits `linear` gives; rows in a batch, and a
    module whose weight was replaced since, run as before."""
    model = arch.pack_decode_weights(arch.fuse_projections(tiny_model("llama").to(torch.bfloat16)))
    layer = arch.decoder_layers(model)[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert all(arch.PACKED in m.__dict__ for m in (attn, mlp, attn.o_proj, mlp.down_proj, model.lm_head))
    calls = []
    real = arch.Packed.__call__
    monkeypatch.setattr(arch.Packed, "__call__", lambda self, x: calls.append(x.shape) or real(self, x))
    linear = torch.nn.functional.linear
    with torch.inference_mode():
        for module in (attn.o_proj, mlp.down_proj, model.lm_head):
            x = torch.randn(1, 1, module.in_features).bfloat16()
            assert torch.equal(arch._linear(module, x), linear(x, module.weight, module.bias))
        x = torch.randn(1, 1, attn.q_proj.in_features).bfloat16()
        fused = attn.__dict__[arch.FUSED]
        assert all(torch.equal(a, b) for a, b in zip(arch._fused(attn, x), linear(x, fused.weight).split(fused.sizes, -1)))
        assert len(calls) == 4
        rows = torch.randn(1, 5, attn.o_proj.in_features).bfloat16()
        assert torch.equal(arch._linear(attn.o_proj, rows), attn.o_proj(rows)) and len(calls) == 4
        attn.o_proj.weight = torch.nn.Parameter(torch.zeros_like(attn.o_proj.weight))   # replaced after packing
        assert not arch._linear(attn.o_proj, x[..., :attn.o_proj.in_features]).any() and len(calls) == 4
