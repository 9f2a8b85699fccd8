"""TieredCache gives transformers' own greedy tokens, with most KV on NVMe."""
import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tierkv.errors import ConfigError, ManagerClosed  # noqa: E402
import tierkv.hf  # noqa: E402
from tierkv.hf import ATTENTION, TieredCache, folded_decode_attention  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, initializer_range=0.2)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
}


def greedy(model, ids, cache, n=12):
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, cache=cache, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def block_bytes(config, block_tokens, dtype=torch.float32):
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * heads * block_tokens * head_dim * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_models_match_dynamic_cache_with_kv_on_nvme(family, tmp_path):
    torch.manual_seed(0)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 256, (1, 640))
    expected = greedy(model, ids, DynamicCache(config=config))
    block = block_bytes(config, 32)
    with TieredCache(config, gpu=4 * block, cpu=8 * block, nvme_dir=tmp_path / "kv", block_tokens=32) as cache:
        assert greedy(model, ids, cache) == expected
        stats = cache.manager.manager.stats
        stored = cache.manager.manager.tiers["nvme"].pool.used
        assert stored > 12 * 3  # most of the 3 layers x 20 blocks sit only on NVMe
        assert stats["nvme"].bytes_out > 0  # and were read back from there
        assert cache.manager.manager.stats["gpu"].peak_slots <= 4


@pytest.mark.model
def test_smollm2_matches_dynamic_cache_with_most_kv_on_nvme(smollm2, tmp_path):
    tok = smollm2.tokenizer
    text = "The pass key is 31337. " + "The grass is green. The sky is blue. " * 90 + "What is the pass key?"
    ids = torch.tensor([tok(text)["input_ids"]])
    model = smollm2.model
    expected = greedy(model, ids, DynamicCache(config=model.config), n=8)
    block = block_bytes(model.config, 64)
    with TieredCache(model.config, gpu=8 * block, cpu=8 * block, nvme_dir=tmp_path / "kv", block_tokens=64) as cache:
        assert greedy(model, ids, cache, n=8) == expected
        mgr = cache.manager.manager
        total = sum(len(row.blocks) for layer in cache.layers for row in layer.rows)
        in_memory = mgr.tiers["gpu"].pool.used + mgr.tiers["cpu"].pool.used
        assert total >= 4 * in_memory  # most KV lives only on NVMe


def generate(model, ids, cache, **kw):
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, cache=cache, pad_token_id=0, **kw)
    return out.tolist()


def spilling(config, tmp_path, block_tokens=32):
    block = block_bytes(config, block_tokens)
    return TieredCache(config, gpu=4 * block, cpu=8 * block, nvme_dir=tmp_path / "kv", block_tokens=block_tokens)


def forced_logits(model, ids, cache, tokens):
    """The logits of each next token as ``tokens`` follow ``ids`` through ``cache``, one step at a time."""
    with torch.inference_mode():
        out = model(ids, cache=cache, use_cache=True)
        logits = [out.logits[0, -1]]
        for token in tokens[:-1]:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return torch.stack(logits).float()


@pytest.mark.model
def test_smollm2_with_int8_blocks_keeps_dynamic_cache_s_logits_from_a_third_of_the_bytes(smollm2, tmp_path):
    # Greedy tokens alone would be a coin toss here: after the repeated filler the model's first two
    # candidates are 0.06 apart, less than int8's error. So both caches are fed DynamicCache's greedy
    # tokens and their logits compared: int8 stays within 0.5 of them at every step (int4 is ~1.7
    # away) and picks the same token wherever DynamicCache's margin is wider than that.
    tok, model = smollm2.tokenizer, smollm2.model
    text = "The pass key is 31337. " + "The grass is green. The sky is blue. " * 90 + "What is the pass key?"
    ids = torch.tensor([tok(text)["input_ids"]])
    tokens = greedy(model, ids, DynamicCache(config=model.config), n=8)
    expected = forced_logits(model, ids, DynamicCache(config=model.config), tokens)
    block = block_bytes(model.config, 64)
    with TieredCache(model.config, gpu=8 * block, cpu=8 * block, nvme_dir=tmp_path / "kv", block_tokens=64,
                     kv_dtype="int8") as cache:
        got = forced_logits(model, ids, cache, tokens)
        assert cache.layout.block_bytes <= 0.3 * block            # fp32 computed, int8 stored
    assert (got - expected).abs().max() < 0.5
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert clear.sum() >= 4
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


@pytest.mark.parametrize("name", ["int3", "bfloat16"])     # (a float dtype was taken, and changed nothing)
def test_a_cache_with_an_unknown_kv_dtype_says_what_is_allowed(name):
    with pytest.raises(ConfigError, match=f"^kv_dtype='{name}': allowed: int8, int4 or int2 .* stored in the dtype "
                                          "the model computes in"):
        TieredCache(FAMILIES["llama"](), kv_dtype=name)
    config = FAMILIES["llama"]()
    with pytest.raises(ConfigError, match=r"^kv_dtype='int4-g3': -g3: must divide the \d+ channels of a head$"):
        TieredCache(config, kv_dtype="int4-g3")            # (it named no argument)


def test_a_cache_made_with_arguments_of_the_wrong_kind_names_them(tmp_path):
    (tmp_path / "file").write_text("")
    for keywords, message in ((dict(block_tokens="256"), "block_tokens='256': expected an integer >= 1"),
                              (dict(block_tokens=0), "block_tokens=0: expected an integer >= 1"),
                              (dict(block_tokens=2.5), "block_tokens=2.5"),
                              (dict(kv_dtype=torch.int8), "kv_dtype=torch.int8: expected a name such as 'int8'"),
                              (dict(nvme_dir=tmp_path / "file"), "nvme_dir='.*file': exists and is not a directory"),
                              (dict(nvme_dir=tmp_path / "file" / "kv"), "cannot create the store's directory"),
                              (dict(gpu=1.5), r"gpu=1.5: a byte count is a whole number")):
        with pytest.raises(ConfigError, match=message):
            TieredCache(FAMILIES["llama"](), **keywords)
    home = tmp_path / "home"
    with pytest.MonkeyPatch.context() as env:                # "~" is the home directory, not a folder named "~"
        env.setenv("HOME", str(home))
        env.chdir(tmp_path)
        TieredCache(FAMILIES["llama"](), nvme_dir="~/kv").close()
    assert (home / "kv").is_dir() and not (tmp_path / "~").exists()
    with pytest.raises(ConfigError, match=r"config: expected the model's transformers config \(model.config\)"):
        TieredCache(None)


def test_caches_of_two_block_layouts_share_one_nvme_dir(tmp_path):
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 256, (1, 100))
    for kv_dtype in (None, "int8"):       # each its own store in the folder, not "holds block_bytes=..."
        with TieredCache(config, gpu=0, cpu="64KiB", nvme_dir=tmp_path, block_tokens=32, kv_dtype=kv_dtype) as cache:
            greedy(model, ids, cache, n=2)
    assert len([p for p in tmp_path.iterdir() if (p / "store.json").is_file()]) == 2


def test_a_budget_too_small_for_one_block_fails_when_the_cache_is_made_not_at_the_first_token():
    config = FAMILIES["llama"]()                    # no dtype named: a block of 16 bits a value, the least it may be
    half = block_bytes(config, 64, torch.bfloat16)
    with pytest.raises(ConfigError, match="gpu='lots': expected a size"):      # named as given, not as buffer
        TieredCache(config, gpu="lots")
    with pytest.raises(ConfigError, match=f"cpu={half - 4096}: a non-zero budget must hold at least one block"):
        TieredCache(config, gpu=0, cpu=half - 4096, block_tokens=64)
    TieredCache(config, gpu=0, cpu=half, block_tokens=64).close()   # (a model cast to bf16 keeps dtype None)
    config.dtype = "float32"                        # the config's dtype sizes the block: twice the bytes
    with pytest.raises(ConfigError, match=f"cpu={half}: a non-zero budget must hold at least one block"):
        TieredCache(config, gpu=0, cpu=half, block_tokens=64)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["beams-2", "beams-4", "prompt-lookup", "assistant"])
def test_generation_modes_that_branch_kv_match_dynamic_cache_on_nvme(family, mode, tmp_path):
    torch.manual_seed(0)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 256, (1, 300))
    ids[0, 200:260] = ids[0, 100:160]                  # repeated text: prompt lookup's drafts hold
    kw = {"beams-2": dict(num_beams=2), "beams-4": dict(num_beams=4),
          "prompt-lookup": dict(prompt_lookup_num_tokens=3), "assistant": dict(assistant_model=draft_of(config))}[mode]
    expected = generate(model, ids, DynamicCache(config=config), max_new_tokens=10, **kw)
    with spilling(config, tmp_path) as cache:
        assert generate(model, ids, cache, max_new_tokens=10, **kw) == expected
        assert cache.manager.manager.stats["nvme"].bytes_out > 0


def draft_of(config):
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(type(config)(**{**SMALL, "num_hidden_layers": 1})).eval()


@pytest.mark.model
@pytest.mark.parametrize("mode", ["beams-2", "prompt-lookup"])
def test_smollm2_beams_and_prompt_lookup_match_dynamic_cache_on_nvme(smollm2, tmp_path, mode):
    text = "The pass key is 31337. " + "The grass is green. The sky is blue. " * 40 + "What is the pass key?"
    ids = torch.tensor([smollm2.tokenizer(text)["input_ids"]])
    kw = dict(num_beams=2) if mode == "beams-2" else dict(prompt_lookup_num_tokens=3)
    model = smollm2.model
    expected = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=8, **kw)
    with spilling(model.config, tmp_path, block_tokens=64) as cache:
        assert generate(model, ids, cache, max_new_tokens=8, **kw) == expected


def test_crop_then_regenerate_equals_the_uncropped_run(tmp_path):
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 256, (1, 150))
    with spilling(config, tmp_path) as cache, torch.inference_mode():
        whole = model(ids, cache=cache).logits[0, -1]
        cache.crop(-53)                                 # into the sealed blocks: one is read back as the tail
        assert cache.get_seq_length() == 97
        again = model(ids[:, 97:], cache=cache).logits[0, -1]
        assert torch.allclose(again, whole, atol=1e-5)


def test_branching_a_fresh_layer_a_mask_and_an_over_long_crop_do_what_dynamic_cache_does(tmp_path):
    """A layer that never took KV (a model whose layers share KV) is reordered without a word; a boolean
    mask keeps the rows it marks; a crop of more than the cache holds empties it."""
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with TieredCache(config, gpu="8MiB", cpu=0, block_tokens=32) as cache, torch.inference_mode():
        cache.reorder_cache(torch.tensor([0, 0]))
        cache.batch_select_indices(torch.tensor([0]))
        model(torch.randint(0, 256, (2, 40)), cache=cache)
        cache.batch_select_indices(torch.tensor([False, True]))
        assert all(len(layer.rows) == 1 for layer in cache.layers)
        cache.crop(-50)
        assert cache.get_seq_length() == 0 and cache.manager.held_blocks() == 0


def test_beams_share_their_prefix_and_a_dropped_branch_frees_only_its_own_blocks(tmp_path):
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with TieredCache(config, gpu="8MiB", cpu=0, block_tokens=32) as cache, torch.inference_mode():
        model(torch.randint(0, 256, (1, 320)), cache=cache)              # 10 blocks per layer
        mgr = cache.manager.manager
        one = mgr.tiers["gpu"].pool.used
        cache.batch_repeat_interleave(4)                                  # four beams over one prompt
        assert mgr.tiers["gpu"].pool.used == one                          # shared: counted once
        model(torch.randint(0, 256, (4, 40)), cache=cache)                # each beam seals blocks of its own
        grown = mgr.tiers["gpu"].pool.used
        assert grown == one + 4 * 3 * 1                                   # 1 new block per beam and layer
        cache.batch_select_indices(torch.tensor([2]))                     # keep one branch, free the others
        kept = {key for layer in cache.layers for row in layer.rows for key in row.blocks}
        assert {e.key for e in mgr.directory if e.copies} == kept and mgr.tiers["gpu"].pool.used == one + 3
        assert all(e.holders == 1 for e in mgr.directory)


def test_close_drops_every_block(tmp_path):
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = TieredCache(config, gpu="1MiB", cpu="1MiB", block_tokens=32)
    greedy(model, torch.randint(0, 256, (1, 100)), cache, n=2)
    assert cache.get_seq_length() == 101 and cache.is_croppable
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)
    manager = cache.manager.manager
    cache.close()
    assert len(manager.directory) == 0
    cache.close()  # idempotent
    with pytest.raises(ManagerClosed, match="this TieredCache was closed"):    # not an AttributeError inside
        greedy(model, torch.randint(0, 256, (1, 10)), cache, n=2)


def test_a_batch_of_two_prompts_matches_dynamic_cache_row_by_row(tmp_path):
    """Two different prompts of one length in one generate call: each row's tokens are DynamicCache's
    (rows keep their own blocks; nothing of one row is read for the other)."""
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 256, (2, 320))
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                  cache=DynamicCache(config=config))[:, ids.shape[1]:]
    block = block_bytes(config, 32)
    with TieredCache(config, gpu=4 * block, cpu=8 * block, nvme_dir=tmp_path / "kv", block_tokens=32) as cache:
        with torch.inference_mode():
            got = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, cache=cache)
        assert torch.equal(got[:, ids.shape[1]:], expected)
        assert cache.manager.manager.stats["nvme"].bytes_out > 0
    alone = [greedy(model, ids[row:row + 1], DynamicCache(config=config), n=10) for row in range(2)]
    assert expected.tolist() == alone                  # a real batch: the rows differ and match alone
    assert alone[0] != alone[1]


class Grouped(torch.nn.Module):
    """What transformers' attention functions read off an attention module."""
    num_key_value_groups, is_causal = 3, True


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_folded_decode_attention_is_sdpa_s_arithmetic_and_only_folds_one_token_queries(dtype, tol, monkeypatch):
    calls = []
    sdpa = tierkv.hf.sdpa_attention_forward
    monkeypatch.setattr(tierkv.hf, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 300, 16, dtype=dtype), torch.randn(2, 2, 300, 16, dtype=dtype)
    padded = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    padded[1, ..., :40] = False                                 # row 1 is left-padded
    for mask in (None, padded):
        q = torch.randn(2, 6, 1, 16, dtype=dtype)
        got, _ = folded_decode_attention(Grouped(), q, k, v, mask, scaling=0.25)
        want, _ = sdpa(Grouped(), q, k, v, mask, scaling=0.25)
        assert got.shape == want.shape == (2, 1, 6, 16)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert calls == []                                          # one-token queries: folded, not delegated
    q = torch.randn(2, 6, 4, 16, dtype=dtype)                   # a draft's 4 tokens: transformers' own sdpa
    causal = torch.ones(4, 300, dtype=torch.bool).tril(296)[None, None].expand(2, 1, 4, 300)
    got, _ = folded_decode_attention(Grouped(), q, k, v, causal, scaling=0.25)
    assert calls == [1]
    assert torch.equal(got, sdpa(Grouped(), q, k, v, causal, scaling=0.25)[0])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiered_cache_with_tierkv_attention_gives_sdpa_s_tokens_for_a_padded_batch_and_drafts(family, tmp_path):
    torch.manual_seed(0)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 256, (2, 300))
    ids[1, :25] = 0                                              # left padding: decode steps carry a mask
    ids[0, 200:260] = ids[0, 100:160]
    mask = (ids != 0).long()
    kw = dict(max_new_tokens=10, attention_mask=mask)
    expected = generate(model, ids, DynamicCache(config=config), **kw)
    drafted = generate(model, ids[:1], DynamicCache(config=config), max_new_tokens=10, prompt_lookup_num_tokens=3)
    model.set_attn_implementation(ATTENTION)
    with spilling(config, tmp_path) as cache:
        assert generate(model, ids, cache, **kw) == expected
    with spilling(config, tmp_path / "drafts") as cache:
        assert generate(model, ids[:1], cache, max_new_tokens=10, prompt_lookup_num_tokens=3) == drafted


def test_a_deep_copy_is_a_fork_that_goes_on_on_its_own_and_shares_the_prefix_s_blocks(tmp_path):
    """transformers' recipe for a prompt's cache reused by several questions: ``copy.deepcopy`` of the
    prefilled cache (it raised "cannot pickle '_thread.lock'"). Each copy answers as a DynamicCache would;
    the prefix's blocks are held, not copied; the tiers live until the last copy closes."""
    import copy
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prefix, questions = torch.randint(1, 256, (1, 150)), [torch.randint(1, 256, (1, 20)) for _ in range(2)]
    block = block_bytes(config, 32)
    want_prompt, got_prompt = DynamicCache(config=config), TieredCache(config, gpu=4 * block, cpu=4 * block,
                                                                     nvme_dir=tmp_path / "kv", block_tokens=32)
    with torch.inference_mode():
        model(prefix, cache=want_prompt)
        model(prefix, cache=got_prompt)
    mgr = got_prompt.manager.manager
    prefix_blocks = {key for layer in got_prompt.layers for row in layer.rows for key in row.blocks}
    assert len(prefix_blocks) == 3 * 4                     # 150 tokens: 4 blocks of 32 a layer
    copies = []
    for question in questions:
        ids = torch.cat([prefix, question], dim=1)
        expected = greedy(model, ids, copy.deepcopy(want_prompt), n=6)
        fork = copy.deepcopy(got_prompt)
        assert fork is not got_prompt and fork.get_seq_length() == 150
        assert greedy(model, ids, fork, n=6) == expected
        copies.append(fork)
    assert got_prompt.get_seq_length() == 150          # the original is as it was
    assert greedy(model, torch.cat([prefix, questions[0]], dim=1), got_prompt, n=6) == \
        greedy(model, torch.cat([prefix, questions[0]], dim=1), copy.deepcopy(want_prompt), n=6)
    manager = got_prompt.manager
    got_prompt.close()
    assert not manager.closed and copies[0].get_seq_length() > 150     # its forks still hold the prefix
    held = {e.key: e.holders for e in mgr.directory}
    assert all(held[key] == 2 for key in prefix_blocks)                  # held by each fork, stored once
    for fork in copies:
        fork.close()
    assert manager.closed


def test_a_cache_filled_under_inference_mode_goes_on_outside_it(tmp_path):
    """Its tails and buffers were inference tensors: a later generate under no_grad (what generate
    itself uses) failed writing to them, and left the layers of different lengths."""
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, more = torch.randint(1, 256, (1, 100)), torch.randint(1, 256, (1, 40))
    block = block_bytes(config, 32)
    want = DynamicCache(config=config)
    with TieredCache(config, gpu=4 * block, cpu=4 * block, nvme_dir=tmp_path / "kv", block_tokens=32) as got:
        first = greedy(model, ids, got, n=6)
        assert first == greedy(model, ids, want, n=6)
        longer = torch.cat([ids, torch.tensor([first]), more], dim=1)
        outs = [model.generate(longer, cache=c, max_new_tokens=6, do_sample=False, pad_token_id=0)
                for c in (want, got)]
        assert outs[0].tolist() == outs[1].tolist()
        got.crop(-10)
        assert {row.length for layer in got.layers for row in layer.rows} == {got.get_seq_length()}


def test_a_fork_let_go_of_unclosed_lets_go_of_its_blocks_and_the_last_closes_the_tiers(tmp_path):
    """transformers' recipe makes a deep copy per question and never closes it: each one held the
    prefix's blocks and its own for as long as the process lived, and the tiers were never closed."""
    import copy
    import gc
    import time
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prefix = torch.randint(1, 256, (1, 150))
    cache = TieredCache(config, gpu="1MiB", cpu="1MiB", block_tokens=32)
    with torch.inference_mode():
        model(prefix, cache=cache)
    manager = cache.manager
    blocks = manager.call(lambda: {e.key: e.holders for e in manager.manager.directory})
    for _ in range(3):
        greedy(model, torch.cat([prefix, torch.randint(1, 256, (1, 40))], dim=1), copy.deepcopy(cache), n=4)
    gc.collect()
    assert manager.call(lambda: {e.key: e.holders for e in manager.manager.directory}) == blocks
    fork = copy.deepcopy(cache)
    cache.close()
    assert not manager.closed
    del fork
    gc.collect()
    deadline = time.monotonic() + 30
    while not manager.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.closed


def test_a_cache_collected_unclosed_leaves_no_block_in_its_store_and_a_script_left_so_exits(tmp_path):
    """Its blocks are keyed under a root of its own, which no later cache finds: left in the store they
    only filled it. A script that never closed its cache or its copies used to hang at exit."""
    import gc
    import subprocess
    import sys
    from tierkv.tiers.nvme import NvmeTier
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = TieredCache(config, gpu="64KiB", cpu="128KiB", nvme_dir=tmp_path / "kv", block_tokens=16)
    greedy(model, torch.randint(1, 256, (1, 300)), cache, n=2)
    manager = cache.manager
    (store,) = (tmp_path / "kv").iterdir()
    del cache
    gc.collect()
    manager._thread.join(timeout=30)
    assert manager.closed and not manager._thread.is_alive()
    with NvmeTier.existing(store) as tier:
        assert next(iter(tier.items()), None) is None
    script = ("import copy, torch, transformers\n"
              "from tierkv.hf import TieredCache\n"
              f"config = transformers.LlamaConfig(**{SMALL!r})\n"
              "model = transformers.AutoModelForCausalLM.from_config(config).eval()\n"
              "ids = torch.randint(1, 256, (1, 200))\n"
              f"cache = TieredCache(config, gpu='64KiB', cpu='128KiB', nvme_dir={str(tmp_path / 'kv2')!r}, block_tokens=16)\n"
              "with torch.inference_mode():\n"
              "    model(ids, cache=cache)\n"
              "model.generate(ids, cache=copy.deepcopy(cache), max_new_tokens=3, do_sample=False, pad_token_id=0)\n"
              "print('end')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "end", done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]
