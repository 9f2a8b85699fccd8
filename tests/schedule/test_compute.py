"""The cell compute: the prefill groups rows without padding and matches a padded batch; --dtype auto detects."""
import pytest
import torch
from schedmodels import loaded_tiny, random_prompts

from tierkv.model import arch
from tierkv.model.arch import decoder_layers
from tierkv.schedule import job
from tierkv.schedule.compute import (
    GpuBatch,
    attend,
    finish_step,
    keep_mask,
    layer_forward,
    prefill_groups,
    start_step,
)


def test_prefill_groups_rows_of_one_length_and_the_short_rows():
    assert prefill_groups([300, 80, 300, 10, 40], short=64) == [[0, 2], [1], [3, 4]]
    assert prefill_groups([16] * 4) == [[0, 1, 2, 3]]


def _padded_prefill(model, batch: GpuBatch, group: int) -> list[int]:
    """The reference: the whole padded batch under the keep-mask (every column computed)."""
    start_step(model, batch, 0, group)
    batch.mask = keep_mask(batch.pad, 0, batch.prompt_len).repeat(1, 1, group, 1)

    for layer in decoder_layers(model):
        h = batch.h
        q, _, k, v = arch.project_qkv(layer, h, batch.cos, batch.sin)
        batch.h = arch.mlp_block(layer, arch.finish_attention(layer, attend(q, k, v, batch.mask), h))
    return batch.h[:, -1]


@torch.no_grad()
def test_grouped_prefill_equals_the_padded_batch():
    loaded = loaded_tiny()
    prompts = random_prompts(5, 3, 90) + [[5] * 70, [6] * 70]       # short rows, long rows, one shared length
    group = loaded.spec.group
    want = _padded_prefill(loaded.model, GpuBatch.from_prompts(prompts, 0), group)
    batch = GpuBatch.from_prompts(prompts, 0)
    start_step(loaded.model, batch, 0, group)
    assert batch.mask is None
    for layer in decoder_layers(loaded.model):
        k, _ = layer_forward(layer, batch, None)
    assert k.shape[2] == batch.prompt_len and torch.equal(k[batch.pad.argmax(), :, 0], torch.zeros_like(k[0, :, 0]))
    torch.testing.assert_close(batch.h[:, -1], want, rtol=1e-4, atol=1e-4)
    assert len(finish_step(loaded.model, batch)) == len(prompts)


@pytest.mark.parametrize(("amx", "bf16", "want"), [(False, False, torch.float32), (True, False, torch.bfloat16),
                                                   (False, True, torch.bfloat16)])
def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it(monkeypatch, amx, bf16, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert job.compute_dtype("auto") is want
    assert job.compute_dtype("float16") is torch.float16
