"""Weights kept quantized in memory: 4-bit layers find a Q4_1 GGUF's own values again, and transformers'
forward and tierkv's own layer functions (the native and sparse engines') run on them alike."""
import pytest
import torch
from torch import nn

from tinymodels import native_logits, tiny_model

from tierkv.errors import ConfigError
from tierkv.model import arch
from tierkv.model.arch import weight_bytes
from tierkv.model.loading import load_model
from tierkv.model.weights import GROUP, Int4Linear, Int8Linear, min_max_groups, quantize_weights


def q4_1_weights(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """What a Q4_1 GGUF dequantizes to, and its q, d, m: each group of 32 is d * q + m, with q 0..15
    reaching both ends (llama.cpp takes m and m + 15 d from the group's min and max), d and m in fp16."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP
    q = torch.randint(0, 16, (out_features, groups, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, groups, 1, generator=g) * 0.05 + 1e-3).half().float()
    m = (torch.randn(out_features, groups, 1, generator=g) * 0.1).half().float()
    return (d * q + m).reshape(out_features, in_features), q.reshape(out_features, -1), d[..., 0], m[..., 0]


def test_4_bit_layers_find_a_q4_1_gguf_values_again():
    weight, q, d, m = q4_1_weights(48, 96)
    found_q, found_d, found_m = min_max_groups(weight)
    assert torch.equal(found_q, q.int())                        # every 4-bit value, exactly
    torch.testing.assert_close(found_d, d, atol=0, rtol=1e-5)   # d and m up to float32 rounding
    torch.testing.assert_close(found_m, m, atol=1e-6, rtol=0)
    linear = nn.Linear(96, 48, bias=True)
    linear.weight.data = weight
    x = torch.randn(3, 5, 96)
    quant = Int4Linear(linear, torch.float32)
    # the products of the dequantized weights, through the kernel's bf16 (its input rows, d, m, output)
    torch.testing.assert_close(quant(x), linear(x), atol=0.05, rtol=0.01)
    assert quant(x).dtype == torch.float32
    assert quant.packed.dtype == torch.uint8 and quant.packed.numel() == 48 * 96 // 2


def test_8_bit_head_and_4_bit_layers_of_any_weights_stay_close():
    torch.manual_seed(0)
    linear = nn.Linear(64, 304, bias=False)
    x = torch.randn(2, 64)
    rel = lambda got: ((got - linear(x)).norm() / linear(x).norm()).item()   # noqa: E731
    assert rel(Int8Linear(linear, torch.float32)(x)) < 0.01
    biased = nn.Linear(64, 304)
    torch.testing.assert_close(Int8Linear(biased, torch.float32)(x), biased(x), atol=0.02, rtol=0.02)
    assert rel(Int4Linear(linear, torch.float32)(x)) < 0.15                   # lossy: plain random weights
    for inputs, outputs in ((48, 16), (64, 8)):
        with pytest.raises(ConfigError, match="multiples of 32, outputs of 16"):
            Int4Linear(nn.Linear(inputs, outputs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_runs_on_the_quantized_weights(dtype):
    model = tiny_model("llama")
    full = weight_bytes(model)
    quantize_weights(model, "int4", dtype)
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is Int4Linear and type(layer.mlp.down_proj) is Int4Linear
    assert type(model.lm_head) is Int8Linear and model.model.embed_tokens.weight.dtype == dtype
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32        # RoPE's angles stay exact
    assert weight_bytes(model) < full
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(ids).logits[0].float()
    got = native_logits(model, ids, chunk=32, block=16)[0].float()
    if dtype == torch.float32:   # the quantized layers take bf16 rows: a float32 difference may round apart
        torch.testing.assert_close(got, expected, atol=0.05, rtol=0.01)
    else:        # bf16: the two attentions round differently too
        torch.testing.assert_close(got, expected, atol=0.15, rtol=0.05)


def test_4_bit_projections_join_into_one_layer_over_the_same_values():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64)
    parts = [Int4Linear(nn.Linear(64, rows), torch.float32) for rows in (128, 64, 64)]
    want = torch.cat([part(x) for part in parts], dim=-1)
    whole = Int4Linear.joined(parts)
    assert torch.equal(whole(x), want) and torch.equal(torch.cat([part(x) for part in parts], dim=-1), want)
    assert parts[1].packed.data_ptr() == whole.packed[128].data_ptr()          # row slices: no second copy
    # parts of rows that do not fill the kernel's blocks of packed rows are not joined
    assert Int4Linear.joined([Int4Linear(nn.Linear(64, rows), torch.float32) for rows in (16, 32)]) is None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_4_bit_projections_run_where_they_join_and_give_the_same_logits(kind):
    model = tiny_model(kind)
    quantize_weights(model, "int4", torch.float32)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want, native = model(ids).logits, native_logits(model, ids, chunk=16, block=8)
    arch.fuse_projections(model)
    layer = arch.decoder_layers(model)[0]
    assert arch.FUSED not in layer.self_attn.__dict__          # k and v: 32 rows, less than a block of packed rows
    fused = layer.mlp.__dict__[arch.FUSED]                      # gate and up: 128 rows each
    assert fused.joined is not None and layer.mlp.up_proj.packed.data_ptr() == fused.joined.packed[128].data_ptr()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)             # transformers' forward: bit for bit
        assert torch.equal(native_logits(model, ids, chunk=16, block=8), native)
        h = torch.randn(1, 2, 64)
        layer.mlp.up_proj.packed = layer.mlp.up_proj.packed.clone()   # its weights replaced after joining
        assert arch._fused(layer.mlp, h) is None
        torch.testing.assert_close(arch.mlp_block(layer, h), h + layer.mlp(layer.post_attention_layernorm(h)))


@pytest.mark.model
def test_the_model_id_keeps_kv_of_quantized_weights_apart(smollm2):
    quant = load_model("smollm2", dtype=torch.bfloat16, weights="int4")
    assert quant.model_id == smollm2.model_id + "+int4g32h8-bf16"     # the scheme: a new one never mixes KV
    assert weight_bytes(quant.model) < 0.6 * weight_bytes(smollm2.model) / 2       # against bf16: 257 -> 144 MiB
    with pytest.raises(ConfigError, match="weights='int3'"):
        load_model("smollm2", weights="int3")


def test_the_settings_name_what_weights_are_allowed():
    from tierkv.model.settings import EngineSettings
    assert EngineSettings(weights="int4").weights == "int4"
    with pytest.raises(ConfigError, match="weights='int8': allowed: int4"):
        EngineSettings(weights="int8")
