"""The native loop: chunked prefill over spilled KV, dense decode, reuse and recovery."""
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from tierkv.config import TierConfig
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine, EngineConfig
from tierkv.session.run import run
from tierkv.model.settings import RunConfig
from tierkv.model.prompt import passkey_prompt
from tierkv.layout import BlockLayout

pytestmark = pytest.mark.model
SMALL_RUN = dict(synthetic_tokens=2300, block_tokens=128, chunk_tokens=512, max_new_tokens=8,
                 gpu_budget="4MiB", cpu_budget="8MiB")


def layout_of(loaded, block_tokens):
    s = loaded.spec
    return BlockLayout.kv(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, block_tokens)


def greedy_native(engine, ids, n):
    seq = engine.new_sequence()
    logits, _ = engine.prefill(seq, ids)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.decode(seq, out[-1])
    return seq, out


def test_native_loop_with_spilling_matches_dynamic_cache_on_2k_prompt(smollm2, tmp_path):
    ids = passkey_prompt(smollm2.tokenizer, 2048).ids
    with torch.inference_mode():
        ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                     cache=DynamicCache(config=smollm2.model.config))
    expected = ref[0, len(ids):].tolist()
    layout = layout_of(smollm2, 256)
    config = TierConfig(block_bytes=layout.block_bytes, gpu=8 * layout.block_bytes,
                        cpu=16 * layout.block_bytes, nvme_dir=tmp_path / "kv")
    with BlockingTierManager.from_config(config, namespace=layout.name) as manager:
        _, out = greedy_native(Engine(smollm2, manager), ids, 8)
        nvme_only = sum(1 for e in manager.manager.directory if list(e.copies) == ["nvme"])
        assert nvme_only > len(manager.manager.directory) // 2  # most KV lived only on disk
    assert out == expected


def test_lost_blocks_mid_decode_are_recomputed(smollm2):
    ids = passkey_prompt(smollm2.tokenizer, 1500).ids
    layout = layout_of(smollm2, 128)
    config = TierConfig(block_bytes=layout.block_bytes, gpu=0, cpu="64MiB")
    with BlockingTierManager.from_config(config) as manager:
        engine = Engine(smollm2, manager, EngineConfig(128, 512))
        _, expected = greedy_native(engine, ids, 6)
        seq = engine.new_sequence()
        logits, _ = engine.prefill(seq, ids)
        out = [int(logits.argmax())]
        manager.drop([seq.blocks[7][3], seq.blocks[20][9]])  # lost from every tier
        for _ in range(5):
            out.append(int(engine.decode(seq, out[-1]).argmax()))
        assert out == expected
        assert all(manager.contains(k) for layer in seq.blocks for k in layer)


def test_second_run_reuses_the_stored_prefix_with_identical_output(smollm2, tmp_path):
    config = RunConfig.of(nvme_dir=tmp_path / "store", **SMALL_RUN)
    first = run(config, loaded=smollm2)
    second = run(config, loaded=smollm2)
    assert first.reused_prompt_tokens == 0
    assert second.reused_prompt_tokens == 2299 // 128 * 128    # whole stored blocks of the document
    assert second.text == first.text
    assert second.tiers["nvme"]["bytes_read"] > 0


def test_int8_blocks_take_half_the_store_and_still_find_the_passkey(smollm2, tmp_path):
    result = run(RunConfig.of(nvme_dir=tmp_path / "store", kv_dtype="int8", **SMALL_RUN), loaded=smollm2)
    assert result.found
    exact, int8 = layout_of(smollm2, 128), EngineConfig(128, kv_dtype="int8").layout(smollm2.spec)
    assert int8.block_bytes <= 0.3 * exact.block_bytes                    # fp32 computed, int8 stored
    (store,) = (tmp_path / "store").iterdir()
    assert store.name == int8.name and "int8" in store.name
    written = result.tiers["nvme"]["bytes_written"]             # the prompt's 17 blocks and decode's 18th
    assert written == (2300 + 8) // 128 * smollm2.spec.num_layers * int8.block_bytes


def test_reusing_stored_blocks_gives_a_fresh_prefill_s_logits_within_rounding(smollm2, tmp_path):
    """Compared as numbers, not as argmax: a near-tie could flip a token on a rounding difference.
    The reused prompt computes from token 768 (three stored 256-token blocks) in chunks [768, 1024)
    and [1024, 1500); the fresh one in [0, 1024) and [1024, 1500): the same sums, ordered apart."""
    ids = passkey_prompt(smollm2.tokenizer, 1500).ids
    layout = layout_of(smollm2, 256)
    config = TierConfig(block_bytes=layout.block_bytes, gpu="64MiB", cpu=0, nvme_dir=tmp_path / "kv")
    with BlockingTierManager.from_config(config, namespace=layout.name) as manager:
        engine = Engine(smollm2, manager)
        fresh, reused = engine.prefill(engine.new_sequence(), ids)
        assert reused == 0
    with BlockingTierManager.from_config(replace(config, nvme_dir=tmp_path / "short"), namespace=layout.name) as manager:
        engine = Engine(smollm2, manager)
        engine.prefill(engine.new_sequence(), ids[:800])
        manager.flush()
        again, reused = engine.prefill(engine.new_sequence(), ids)
    assert reused == 768
    scale = float(fresh.abs().max())
    assert float((again - fresh).abs().max()) <= 1e-4 * scale


def test_corrupt_store_is_recomputed_not_served(smollm2, tmp_path, caplog):
    """Exponent bytes flipped in several stored blocks (values off by factors of 2**64, not rounding):
    the checksums catch them, the run computes those blocks again and gives the clean text."""
    config = RunConfig.of(nvme_dir=tmp_path / "store", **SMALL_RUN | dict(synthetic_tokens=1200))
    clean = run(config, loaded=smollm2)
    slots = next((tmp_path / "store").rglob("slots.dat"))
    with open(slots, "r+b") as f:  # flip the high byte of a float32 in each of several stored blocks
        for offset in [i * slots.stat().st_size // 8 for i in range(7)]:
            f.seek(offset + 103)
            byte = f.read(1)
            f.seek(offset + 103)
            f.write(bytes([byte[0] ^ 0x40]))
    done: list[int] = []
    with caplog.at_level("WARNING", logger="tierkv.model.engine"):
        again = run(config, loaded=smollm2, on_prefill=lambda tokens, total: done.append(tokens))
    assert again.text == clean.text
    assert done[-1] == 1199 and max(done) == 1199       # the progress went back with the rewind, not past the end
    assert "failed their checksum" in caplog.text
    rewinds = [r.message for r in caplog.records if "computing the sequence again" in r.message]
    assert len(rewinds) == 1 and "7 of its" in rewinds[0]       # one scrub finds them all: one rewind
    assert again.reused_prompt_tokens == 0        # slot 0, the first block, was damaged: nothing was reused


def _tierkv(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "tierkv.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, **kw)


def test_sigkill_during_prefill_then_rerun_gives_the_clean_output(smollm2, tmp_path):
    args = ["--synthetic-tokens", "2000", "--block-tokens", "128", "--chunk-tokens", "512",
            "--max-new-tokens", "8", "--cpu-budget", "8MiB", "--gpu-budget", "4MiB", "--json"]
    clean = json.loads(_tierkv(*args, "--nvme-dir", str(tmp_path / "clean")).communicate(timeout=600)[0])
    store = tmp_path / "store"
    victim = _tierkv(*args, "--nvme-dir", str(store))
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until some blocks are journaled, then kill mid-prefill
        journals = list(store.rglob("index.log"))
        if journals and journals[0].stat().st_size > 250 * 48:  # > one chunk x 30 layers of blocks
            break
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    again = json.loads(_tierkv(*args, "--nvme-dir", str(store)).communicate(timeout=600)[0])
    assert again["text"] == clean["text"]
    assert victim.returncode == -signal.SIGKILL  # it was killed, not finished
    assert again["reused_prompt_tokens"] >= 512


def test_a_forked_sequence_diverges_and_freeing_one_branch_frees_only_its_own_blocks(smollm2):
    ids = passkey_prompt(smollm2.tokenizer, 600).ids
    layout = layout_of(smollm2, 128)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="64MiB", cpu=0)) as manager:
        engine = Engine(smollm2, manager, EngineConfig(128, 512))
        seq = engine.new_sequence()
        logits, _ = engine.prefill(seq, ids)
        mgr = manager.manager
        shared = mgr.tiers["gpu"].pool.used                       # 4 blocks x 30 layers
        branch = seq.fork()
        assert mgr.tiers["gpu"].pool.used == shared               # a fork copies no block
        a, _ = engine.extend(seq, list(range(10, 110)))            # 100 tokens each: one more block each
        b, _ = engine.extend(branch, list(range(200, 300)))
        assert not torch.equal(a, b) and mgr.tiers["gpu"].pool.used == shared + 2 * 30
        seq.release(keep=False)
        kept = {key for layer in branch.blocks for key in layer}
        assert {e.key for e in mgr.directory} == kept and all(e.holders == 1 for e in mgr.directory)
        before, _ = engine.extend(branch, [5])                    # the branch reads on, unharmed
        branch.crop(1)
        assert torch.allclose(engine.extend(branch, [5])[0], before, atol=1e-4)
        tokens = list(branch.token_ids)                           # 601 + 100 ... + 5
        branch.crop(150)                                          # into a sealed block: read back as the tail
        assert branch.length() == len(tokens) - 150 and branch.token_ids == tokens[:-150]
        again, _ = engine.extend(branch, tokens[-150:])
        assert torch.allclose(again, before, atol=1e-3)
        branch.release(keep=False)
        assert len(mgr.directory) == 0


def test_a_run_stopped_mid_answer_writes_what_it_recorded_as_partial(smollm2, tmp_path, caplog):
    """A stopped run wrote no trace and said nothing, leaving an earlier run's trace to be profiled."""
    from tierkv.profile.trace import read_trace
    from tierkv.profile.summary import summarize
    trace, access = tmp_path / "t.json", tmp_path / "a.tkv"
    trace.write_text("an earlier run's")
    access.write_text("an earlier run's")
    config = RunConfig.of(trace=trace, record_access=access, nvme_dir=tmp_path / "store",
                          **SMALL_RUN | dict(synthetic_tokens=600, chunk_tokens=256))

    def stop(piece: str) -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run(config, loaded=smollm2, on_text=stop)
    read = read_trace(trace)
    assert read.meta["partial"] == "interrupted" and any(e.kind == "put" for e in read.events)
    notes = summarize(read.events, read.meta, phase="all").notes
    assert any("the run stopped before its end (interrupted)" in note for note in notes)
    assert access.read_bytes().startswith(b"TKVTRACE")
    with pytest.raises(KeyboardInterrupt):                  # stopped before it recorded anything: no file at all
        run(config, loaded=smollm2, on_prefill=lambda done, total: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert not trace.exists() and not access.exists()
    caplog.clear()
    with caplog.at_level("WARNING", logger="tierkv.session.run"):   # no file asked for: nothing said ("the run
        with pytest.raises(KeyboardInterrupt):                      # stopped (interrupted):  holds what it did")
            run(config.updated(trace=None, record_access=None), loaded=smollm2, on_text=stop)
    assert "holds what it did" not in caplog.text and "hold what it did" not in caplog.text
