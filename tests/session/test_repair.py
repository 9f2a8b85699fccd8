"""A stored sparse document with damaged or lost pages: the next run repairs them (replaying its prefill
from a restore point) and answers as a clean run does; a whole-store scrub then finds nothing."""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tierkv.cli import main
from tierkv.errors import BlockMissing, ConfigError
from tierkv.keys import BlockKey
from tierkv.failpoints import POINTS
from tierkv.model.arch import model_spec
from tierkv.model.loading import LoadedModel
from tierkv.model.settings import SessionConfig
from tierkv.session import Session
from tierkv.session import scrub
from tierkv.session.repair import Repair
from tierkv.session.scrub import IndexCheck, StoreCheck, Verdict, repair_store, verify
from tierkv.sparse import restore
from tierkv.tiers.nvme import NvmeTier

from tinymodels import tiny_model

IDS = torch.randint(0, 128, (2400,), generator=torch.Generator().manual_seed(7)).tolist()
PROMPT = [*IDS, 5, 6, 7]
SETTINGS = dict(gpu_budget="1MiB", cpu_budget="2MiB", mode="sparse", chunk_tokens=256, sparse_budget=128,
                page_tokens=16)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    model = tiny_model("llama")                           # trained window 512 tokens, no tokenizer
    return LoadedModel(model, None, "tiny-llama", model_spec(model))


@pytest.fixture(autouse=True)
def close_restore_points(monkeypatch):
    monkeypatch.setattr(restore, "MIN_SPACING", 256)      # a restore point every 256 tokens of the document


def answer(lm: LoadedModel, store: Path, **settings):
    with Session(SessionConfig.of(nvme_dir=store, **SETTINGS | settings), loaded=lm) as session:
        return session.complete(PROMPT, max_new_tokens=8)


def page_store(store: Path) -> tuple[Path, int]:
    (directory,) = store.glob("sparse-P*")
    return directory, json.loads((directory / "store.json").read_text())["block_bytes"]


def stored_slots(store: Path) -> list[int]:
    with NvmeTier.existing(page_store(store)[0]) as tier:
        return sorted(slot for _, slot in tier.items())


def stored_blocks(store: Path) -> dict[bytes, bytes]:
    """Every page in the store, by key, as its bytes (checked against their checksums)."""
    with NvmeTier.existing(page_store(store)[0]) as tier:
        items = sorted(tier.items())
        data = torch.empty(len(items), tier.block_bytes, dtype=torch.uint8)
        assert tier.read([(key, slot, data[i]) for i, (key, slot) in enumerate(items)]) == []
        return {key.digest: data[i].numpy().tobytes() for i, (key, _) in enumerate(items)}


def flip_high_bytes(store: Path, slots: list[int], rng: random.Random) -> None:
    """Exponent bytes of float32 values, as a bad sector or a torn copy would leave them."""
    directory, block_bytes = page_store(store)
    with open(directory / "slots.dat", "r+b") as f:
        for slot in slots:
            for _ in range(8):
                at = slot * block_bytes + rng.randrange(block_bytes // 4) * 4 + 3
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ 0x40]))


def test_flipped_bytes_in_a_few_percent_of_the_pages_cost_a_repair_not_the_answer(lm, tmp_path):
    clean = answer(lm, tmp_path)
    pages = stored_blocks(tmp_path)
    slots = stored_slots(tmp_path)
    damaged = random.Random(3).sample(slots, max(2, len(slots) * 3 // 100))
    flip_high_bytes(tmp_path, damaged, random.Random(4))
    again = answer(lm, tmp_path)
    assert again.reused_tokens == len(PROMPT) - 1                    # the stored state, not a new prefill
    assert again.tokens == clean.tokens
    (repair,) = again.report["repairs"]
    assert repair["pages"] == len(damaged) and repair["scrubbed"] == len(slots)
    assert 0 < repair["tokens"] < len(PROMPT)
    after = stored_blocks(tmp_path)                                  # byte for byte what the prefill wrote
    assert {key: after[key] for key in pages} == pages
    third = answer(lm, tmp_path)                                     # repaired for good
    assert third.tokens == clean.tokens and third.report["repairs"] == []
    assert main(["store", "verify", "--nvme-dir", str(tmp_path)]) == 0


@pytest.mark.parametrize("exact", [1024, 4096], ids=["first-part-exact", "all-exact"])
def test_damaged_pages_of_the_exact_part_of_the_prefill_are_repaired(lm, tmp_path, exact):
    """The pages of a document's exact prefill (its first half-window past the trained window, all of
    it within) are sealed only when the key basis is fit at its end: a replay must run that far."""
    prompt, config = PROMPT, SessionConfig.of(nvme_dir=tmp_path, **SETTINGS, dense_prefill_tokens=exact)
    with Session(config, loaded=lm) as session:
        clean = session.complete(prompt, max_new_tokens=8)
    pages = stored_blocks(tmp_path)
    flip_high_bytes(tmp_path, stored_slots(tmp_path)[:3], random.Random(5))   # the first pages written
    repaired = repair_store(tmp_path, config, loaded=lm)
    (index,) = [i for i in repaired.indexes if i.kind == "index"]
    assert index.repair is not None and index.repair.pages == 3 and not index.note
    assert 0 < index.repair.tokens <= len(prompt) - 1
    assert verify(tmp_path).clean and stored_blocks(tmp_path) == pages
    with Session(config, loaded=lm) as session:
        again = session.complete(prompt, max_new_tokens=8)
    assert again.reused_tokens == len(prompt) - 1 and again.tokens == clean.tokens


def test_store_verify_finds_every_damaged_page_and_repair_computes_them_again(lm, tmp_path, capsys, monkeypatch):
    clean = answer(lm, tmp_path)
    pages = stored_blocks(tmp_path)
    damaged = random.Random(8).sample(stored_slots(tmp_path), 5)
    flip_high_bytes(tmp_path, damaged, random.Random(9))
    assert main(["store", "verify", "--nvme-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "5 damaged" in out and "5 missing or damaged" in out and "DAMAGED" in out
    monkeypatch.setattr(scrub, "repair_store", functools.partial(scrub.repair_store, loaded=lm))
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    assert main(["store", "repair", "--nvme-dir", str(tmp_path), *flags, "--json"]) == 0
    repaired = json.loads(capsys.readouterr().out)            # one object: the repair, and the check after it
    (index,) = [i for i in repaired["repair"]["indexes"] if i["kind"] == "index"]
    assert index["repair"]["pages"] == 5 and not index["note"]
    assert repaired["clean"] and repaired["verify"]["clean"] and repaired["action"] == "repair"
    assert verify(tmp_path).clean and stored_blocks(tmp_path) == pages
    again = answer(lm, tmp_path)
    assert again.tokens == clean.tokens and again.report["repairs"] == []


def test_an_index_s_pages_count_only_in_its_own_layout_s_store(lm, tmp_path):
    """verify looked each page up in every store of the directory: pages held only by another layout's store
    (here the store's folder renamed to another layout's name) were "clean", and a run computed them all again."""
    answer(lm, tmp_path)
    directory, _ = page_store(tmp_path)
    assert verify(tmp_path).clean
    directory.rename(directory.with_name(directory.name.replace("-P16-", "-P32-")))
    verdict = verify(tmp_path)
    (index,) = [i for i in verdict.indexes if i.kind == "index"]
    assert index.pages > 0 and len(index.bad_pages) == index.pages
    assert "store.json is another store's" in verdict.lines()[0] and "renamed" in verdict.lines()[0]   # its
    assert not verdict.stores[0].clean        # blocks all sound, but it is not the store its store.json names


def test_verify_writes_nothing_and_finds_the_damage_a_repair_s_joined_read_finds(lm, tmp_path, capsys):
    """Verify reads each store without joining it (joining writes an owner file and the claims, cuts a
    torn journal): a read-only file system or another user's store is verified, and no byte changes."""
    answer(lm, tmp_path)
    damaged = random.Random(8).sample(stored_slots(tmp_path), 4)
    flip_high_bytes(tmp_path, damaged, random.Random(9))
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["store", "verify", "--nvme-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "4 damaged" in out and "4 missing or damaged" in out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    alone = verify(tmp_path)
    joined = verify(tmp_path, drop=True)
    assert [(s.blocks, sorted(s.damaged)) for s in alone.stores] == [(s.blocks, sorted(s.damaged)) for s in joined.stores]


@pytest.mark.skipif(os.geteuid() != 0, reason="root verifies another user's store: root only")
def test_root_verifies_another_user_s_store_without_making_files_there(tmp_path):
    """Root may write anywhere, but an owner file, claims or a rewritten journal made by root would lock
    the store's owner out: verify reads such a store without joining it."""
    with NvmeTier(tmp_path / "theirs", 4096, 64 * 4096) as tier:
        slots = [tier.pool.reserve() for _ in range(4)]
        tier.write([(BlockKey.of("b", i), slot, torch.full((4096,), i, dtype=torch.uint8))
                    for i, slot in enumerate(slots)])
    for path in [tmp_path, *tmp_path.rglob("*")]:
        os.chown(path, 65534, 65534)
    before = {p: (p.read_bytes() if p.is_file() else None, p.stat().st_uid) for p in tmp_path.rglob("*")}
    verdict = verify(tmp_path)
    assert [(s.blocks, s.damaged, s.clean) for s in verdict.stores] == [(4, [], True)]
    assert {p: (p.read_bytes() if p.is_file() else None, p.stat().st_uid) for p in tmp_path.rglob("*")} == before


def test_an_index_with_changed_metadata_is_refused_and_prefilled_again(lm, tmp_path):
    clean = answer(lm, tmp_path)
    (path,) = [p for p in (tmp_path / "sparse-indexes").glob("*.safetensors") if ".restore-" not in p.name]
    tensors = load_file(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    lengths = json.loads(meta["tokens"])
    save_file(tensors, str(path), metadata=meta | {"tokens": json.dumps([n - 16 for n in lengths])})
    assert not verify(tmp_path).clean
    again = answer(lm, tmp_path)
    assert again.reused_tokens == 0 and again.tokens == clean.tokens        # prefilled, never read wrong


def test_lost_pages_are_rebuilt_when_the_document_is_loaded(lm, tmp_path):
    clean = answer(lm, tmp_path)
    with NvmeTier.existing(page_store(tmp_path)[0]) as tier:
        keys = sorted(key for key, _ in tier.items())
        for key in random.Random(5).sample(keys, 3):
            tier.drop(key)
    again = answer(lm, tmp_path)
    assert again.tokens == clean.tokens and again.reused_tokens == len(PROMPT) - 1
    assert again.report["repairs"][0]["pages"] == 3


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from tinymodels import tiny_model
    from tierkv.model.arch import model_spec
    from tierkv.model.loading import LoadedModel
    from tierkv.model.settings import SessionConfig
    from tierkv.session import Session
    from tierkv.sparse import restore
    import test_repair as t
    restore.MIN_SPACING = 256
    model = tiny_model("llama")
    lm = LoadedModel(model, None, "tiny-llama", model_spec(model))
    with Session(SessionConfig.of(nvme_dir=sys.argv[1], checkpoint_every=1e-6, **t.SETTINGS), loaded=lm) as s:
        s.complete(t.PROMPT, max_new_tokens=8)
    print("finished")
""")


@pytest.fixture(scope="module")
def clean_answer(lm, tmp_path_factory):
    return answer(lm, tmp_path_factory.mktemp("clean"))


def kill_points() -> list[str]:
    """Two kills in CI (the store's own points: tests/tiers/test_nvme_crash.py; an index save resumes from
    its checkpoint); ``TIERKV_SPARSE_KILLS=N``: N at every point, at visits drawn at random (bench/RESULTS.md)."""
    many = int(os.environ.get("TIERKV_SPARSE_KILLS", "0"))
    if not many:
        return ["restore.before-rename:4", "index.before-rename"]
    rng, visits = random.Random(many), {"index.before-rename": 1, "restore.before-rename": 6,
                                        "checkpoint.before-rename": 6}    # the store's points: 20
    return [f"{point}:{rng.randint(1, visits.get(point, 20))}" for point in (POINTS * many)[:many]]


@pytest.mark.parametrize("point", kill_points())
def test_a_sparse_prefill_killed_at_a_failpoint_resumes_to_the_clean_answer(lm, clean_answer, tmp_path, point):
    """A real SIGKILL inside the prefill of a stored document (its checkpoint, restore point or index
    half saved, a page's bytes written but not its record): the next run finishes what was stored
    and answers as a clean run does."""
    tests = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(tests)], capture_output=True, text=True,
                           env=os.environ | {"TIERKV_FAILPOINTS": point, "PYTHONPATH": str(Path(__file__).parent)},
                           timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert "finished" not in child.stdout
    again = answer(lm, tmp_path, checkpoint_every=1e-6)
    assert again.tokens == clean_answer.tokens
    name, _, visit = point.partition(":")
    if name == "index.before-rename" or (name == "checkpoint.before-rename" and int(visit or 1) > 1):
        assert again.report["resumed_prefill_tokens"] > 0           # from a checkpoint saved before the kill
    assert verify(tmp_path).clean


def test_a_repair_beside_another_opener_says_the_lost_blocks_are_hidden_not_dropped(tmp_path):
    """Another process has the store open: a repair may not rewrite its journal, so the blocks past a data
    file cut short are hidden from the repair only, and it says so (verify after it still finds them)."""
    with NvmeTier(tmp_path / "s", 4096, 16 * 4096) as tier:
        slots = [tier.pool.reserve() for _ in range(6)]
        tier.write([(BlockKey.of("r", i), slot, torch.full((4096,), i, dtype=torch.uint8))
                    for i, slot in enumerate(slots)])
    other = subprocess.Popen([sys.executable, "-c", "import sys, time; from tierkv.tiers.nvme import NvmeTier\n"
                              f"t = NvmeTier.existing({str(tmp_path / 's')!r}); print('open', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "open\n"
        os.truncate(tmp_path / "s" / "slots.dat", 4 * 4096)           # (an opener alone drops them at once)
        (line,) = verify(tmp_path, drop=True).lines()[:1]
        assert "2 hidden from this repair: another process has the store open" in line
        assert not verify(tmp_path).clean
    finally:
        other.communicate("", timeout=60)
    (line,) = verify(tmp_path, drop=True).lines()[:1]
    assert "2 dropped" in line and verify(tmp_path).clean


def test_a_repair_s_own_report_says_what_it_found_was_repaired():
    damaged = [IndexCheck(Path("doc.idx"), "index", tokens=100, pages=10, bad_pages=[None])]
    assert Verdict(indexes=damaged, repaired=True).lines()[-1].startswith(
        "damage found; the check after the repair says what is left")
    assert Verdict(indexes=damaged).lines()[-1].startswith("DAMAGED")
    assert Verdict(repaired=True).lines()[-1].startswith("clean")
    shared = StoreCheck(Path("kv"), blocks=6, damaged=[BlockKey.of("x")], shared=True)   # (the check after still
    assert "those in another opener's slots are only hidden from this repair" in shared.line(True)   # found them:
                                                                                                   # why, not said)
    assert "hidden" not in shared.line(False) and "hidden" not in replace(shared, shared=False).line(True)
    recomputed = [IndexCheck(Path("doc.idx"), "index", tokens=100, pages=10, repair=Repair(1, 10, 0.1, 0, 64, 1.0))]
    assert Verdict(indexes=recomputed, repaired=True).lines()[-1].startswith("damage found")   # it said "clean"


def _six_blocks(directory):
    with NvmeTier(directory, 4096, 16 * 4096) as tier:
        slots = [tier.pool.reserve() for _ in range(6)]
        tier.write([(BlockKey.of("m", i), slot, torch.full((4096,), i, dtype=torch.uint8))
                    for i, slot in enumerate(slots)])
    return json.loads((directory / "store.json").read_text())


def test_a_changed_store_json_is_found_and_a_repair_drops_no_block_of_it(tmp_path):
    """One number changed in store.json (its block size) made every block read at other offsets: verify
    called all of them damaged and a repair dropped every one, the document's whole KV lost for good."""
    manifest = _six_blocks(tmp_path / "s")
    changed = {**manifest, "block_bytes": 2048}
    (tmp_path / "s" / "store.json").write_text(json.dumps(changed))
    for drop in (False, True):
        (line,) = verify(tmp_path, drop=drop).lines()[:1]
        assert "unusable (store.json fails its checksum" in line and "rebuilds it from its blocks" in line
    with pytest.raises(ConfigError, match="store.json fails its checksum"):
        NvmeTier(tmp_path / "s", 4096, 16 * 4096)              # (its namespace is not the store's name: not rebuilt)
    # a store made before store.json had a checksum: every block failing is named, and none is dropped
    (tmp_path / "s" / "store.json").write_text(json.dumps({k: v for k, v in changed.items() if k != "check"}))
    (line,) = verify(tmp_path, drop=True).lines()[:1]
    assert "6 blocks, 6 damaged: every one" in line and "store.json is likely not" in line and "nothing dropped" in line
    (tmp_path / "s" / "store.json").write_text(json.dumps(manifest))
    assert verify(tmp_path).clean and verify(tmp_path).lines()[0].startswith("store s: 6 blocks, all sound")
    # a store of a later format is not called damaged: it is another version's
    (tmp_path / "s" / "store.json").write_text(json.dumps({**manifest, "version": 2, "check": "0"}))
    with pytest.raises(ConfigError, match="format 'tierkv-nvme' v2; this tierkv reads 'tierkv-nvme' v1"):
        NvmeTier(tmp_path / "s", 4096, 16 * 4096)
    # with its store.json checked, a store whose every block fails lost them all (slots.dat overwritten): dropped
    (tmp_path / "s" / "store.json").write_text(json.dumps(manifest))
    size = (tmp_path / "s" / "slots.dat").stat().st_size
    (tmp_path / "s" / "slots.dat").write_bytes(b"\xff" * size)
    (line,) = verify(tmp_path, drop=True).lines()[:1]
    assert line == "store s: 6 blocks, 6 damaged"
    assert verify(tmp_path).lines()[0] == "store s: 0 blocks, all sound"


def test_a_folder_in_place_of_a_store_file_is_named_not_a_traceback(tmp_path):
    _six_blocks(tmp_path / "s")
    (tmp_path / "s" / "slots.dat").unlink()
    (tmp_path / "s" / "slots.dat").mkdir()
    (line,) = verify(tmp_path).lines()[:1]
    assert line.startswith("store s: unusable (slots.dat is not a file); move the store aside")
    with pytest.raises(ConfigError, match="slots.dat is not a file"):
        NvmeTier(tmp_path / "s", 4096, 16 * 4096)


def test_questions_leave_no_page_of_their_own_in_the_store(lm, tmp_path):
    """A question's pages (its prompt's and answer's, keyed under a private root no run finds again) spilled
    to the store when memory was small and stayed there, taking store space for good."""
    store = tmp_path / "kv"
    small = SETTINGS | dict(gpu_budget="256KiB", cpu_budget="512KiB")      # the questions' pages spill to it
    with Session(SessionConfig.of(nvme_dir=store, **small), loaded=lm) as session:
        session.read_ids(IDS)
        for question in range(3):
            answer = session.complete([*IDS, question, *range(10, 110)], max_new_tokens=8)
            assert answer.reused_tokens == len(IDS)
    stored = len(stored_slots(store))
    indexed = sum(i.pages for i in verify(store).indexes if i.kind == "index")
    assert stored == indexed > 0


def test_a_folder_where_an_index_belongs_is_named_before_the_prefill_and_by_verify(lm, tmp_path):
    """The index's path taken by a folder: a run prefilled the whole document, then failed at the rename
    with a bare errno and left its temporary file (the index's size) behind; verify said "No such device".
    A file named like the index folder: verify said clean, a run failed with "File exists"."""
    store = tmp_path / "kv"
    answer(lm, store)
    (index,) = (p for p in (store / "sparse-indexes").glob("*.safetensors") if ".restore-" not in p.name)
    index.unlink()
    index.mkdir()
    with pytest.raises(ConfigError, match=f"sparse index {index}: not a file; move it aside"):
        answer(lm, store)
    assert not list(index.parent.glob("*.tmp"))
    assert f"index {index.name}: unusable (not a file)" in verify(store).lines()
    index.rmdir()
    other = tmp_path / "other"
    (other / "sparse-indexes").parent.mkdir()
    (other / "sparse-indexes").write_text("a note")
    with pytest.raises(ConfigError, match="sparse-indexes: not a folder"):
        answer(lm, other)
    answer(lm, store)                         # (the store made in "other" is left unchecked by verify: no store there)
    (store / "sparse-indexes").rename(tmp_path / "moved")
    (store / "sparse-indexes").write_text("a note")
    lines = verify(store).lines()
    assert "index folder sparse-indexes: unusable (not a folder: no document can be stored; move it aside)" in lines
    assert lines[-1].startswith("DAMAGED")


def test_a_repair_with_other_settings_names_them_and_leaves_no_store_of_its_own(lm, tmp_path):
    """It said only "other sparse settings than given here", and left an empty store of the settings given."""
    answer(lm, tmp_path)
    flip_high_bytes(tmp_path, stored_slots(tmp_path)[:3], random.Random(3))
    stores = sorted(p.name for p in tmp_path.iterdir())
    other = SessionConfig.of(**SETTINGS | dict(page_tokens=32, rank=8))
    verdict = repair_store(tmp_path, other, loaded=lm)
    (index,) = [i for i in verdict.indexes if i.kind == "index"]
    assert index.note.startswith("not repaired: stored with another model or other sparse settings than given here (")
    assert "(stored with --rank the default (given 8), --page-tokens 16 (given 32))" in index.note
    assert "positions" not in index.note and "dense_prefill" not in index.note    # as resolved for the document
    assert sorted(p.name for p in tmp_path.iterdir()) == stores
    quantized = SessionConfig.of(**SETTINGS | dict(page_tokens=None, page_dtype="int4"))
    (index,) = [i for i in repair_store(tmp_path, quantized, loaded=lm).indexes if i.kind == "index"]
    assert "(stored with --page-dtype the default (given int4))" in index.note   # not --page-tokens 16 (given 96)
    shutil.rmtree(tmp_path)                                                        # too: the default dtype's own
    answer(lm, tmp_path, page_tokens=32)                                           # a page size of its own: named
    flip_high_bytes(tmp_path, stored_slots(tmp_path)[:3], random.Random(3))
    (index,) = [i for i in repair_store(tmp_path, quantized, loaded=lm).indexes if i.kind == "index"]
    assert "(stored with --page-tokens 32 (given 96), --page-dtype the default (given int4))" in index.note


def test_a_damaged_journal_record_makes_verify_call_the_store_damaged(tmp_path, capsys):
    """The block a record in the middle of index.log stored is lost: the verdict is not clean (exit 1)."""
    from tierkv.tiers.journal import RECORD_BYTES
    _six_blocks(tmp_path / "s")
    journal = tmp_path / "s" / "index.log"
    raw = bytearray(journal.read_bytes())
    raw[len(raw) - 3 * RECORD_BYTES + 10] ^= 1             # a record with whole ones after it
    journal.write_bytes(bytes(raw))
    verdict = verify(tmp_path)
    assert verdict.stores[0].bad_records == 1 and not verdict.clean
    assert main(["store", "verify", "--nvme-dir", str(tmp_path)]) == 1
    assert "1 damaged journal record(s)" in capsys.readouterr().out


def test_a_replay_that_seals_no_damaged_page_again_is_not_called_a_repair(lm, tmp_path, monkeypatch):
    """A replay that stops before the damaged pages are sealed again must say so (BlockMissing), not
    record a repair that did not happen."""
    from tierkv.session import repair as repair_module
    clean = answer(lm, tmp_path)
    flip_high_bytes(tmp_path, random.Random(5).sample(stored_slots(tmp_path), 3), random.Random(6))
    monkeypatch.setattr(repair_module, "_until", lambda seq, places: 0)
    try:
        again = answer(lm, tmp_path)
    except BlockMissing as error:
        assert "were not sealed again by a replay" in str(error)
    else:
        assert again.report["repairs"] == [] and again.tokens == clean.tokens


def test_pages_the_remote_lost_are_replayed_from_its_shared_restore_points(lm, tmp_path, redis_server):
    """A document read from the remote store into an empty one, the remote having lost its last pages
    (evicted): the restore points were shared after the index, so the replay starts at the one before
    them, fetched when the repair needs it (and no other)."""
    clean = answer(lm, tmp_path / "a", remote=redis_server.url)
    client = redis_server.client()
    shared = [n.decode() for key in client.keys(b"tierkv:*:files") for n in client.smembers(key)]
    assert sum(".restore-" in name for name in shared) >= 8                  # a point every 256 of 2,400 tokens
    with NvmeTier.existing(page_store(tmp_path / "a")[0]) as tier:
        last = sorted(tier.items(), key=lambda item: item[1])[-3:]          # sealed last
    for key, _ in last:
        (name,) = client.keys(b"tierkv:*:b:" + key.hex().encode())
        client.delete(name)
    again = answer(lm, tmp_path / "b", remote=redis_server.url)
    assert again.tokens == clean.tokens and again.reused_tokens == len(PROMPT) - 1
    (repair,) = again.report["repairs"]
    assert repair["pages"] == 3 and repair["start"] >= 1792, repair
    fetched = list((tmp_path / "b" / "sparse-indexes").glob("*.restore-*"))
    assert len(fetched) == 1 and fetched[0].name.endswith(f".restore-{repair['start']}.safetensors")   # that one


def test_a_damaged_store_json_is_rebuilt_by_the_repair_given_the_run_s_settings_and_the_answer_kept(lm, tmp_path):
    """A damaged store.json made the store unusable: every run refused it, and the advice was to remove
    it, its blocks sound. A repair with the run's settings opens it as a run would, and its blocks vouch
    for the block size and namespace those settings ask for."""
    dense = dict(mode="dense", gpu_budget="1MiB", cpu_budget="1MiB")
    before = answer(lm, tmp_path, **dense)
    (directory,) = tmp_path.glob("kv-*")
    manifest = json.loads((directory / "store.json").read_text())
    answer(lm, tmp_path / "another", block_tokens=128, **dense)                    # another layout's store
    (foreign,) = (tmp_path / "another").glob("kv-*")
    for damage in ('{"format": "tierkv-nvme", "vers', json.dumps({**manifest, "block_bytes": 1024}),
                   (foreign / "store.json").read_text(), None):
        if damage is None:                                                       # no store.json at all
            (directory / "store.json").unlink()
        else:
            (directory / "store.json").write_text(damage)
        assert "rebuilds it from its blocks" in verify(tmp_path).lines()[0]
        other = repair_store(tmp_path, SessionConfig.of(nvme_dir=tmp_path, block_tokens=128, **dense), loaded=lm)
        assert not other.clean and ("unusable" in other.lines()[0] or "nothing dropped" in other.lines()[0])
        assert sorted(p.name for p in tmp_path.glob("*-*") if p.is_dir()) == [directory.name]  # nothing left made
        repaired = repair_store(tmp_path, SessionConfig.of(nvme_dir=tmp_path, **SETTINGS | dense), loaded=lm)
        assert repaired.clean, repaired.lines()
        assert json.loads((directory / "store.json").read_text()) | {"created": 0} == manifest | {"created": 0}
    again = answer(lm, tmp_path, **dense)
    assert again.text == before.text and again.reused_tokens >= len(PROMPT) - 256


def _indexes(store: Path) -> set[Path]:
    return {p for p in (store / "sparse-indexes").glob("*.safetensors") if p.name.count(".") == 1}


def test_an_index_renamed_over_another_document_s_is_not_served_and_verify_names_it(lm, tmp_path):
    """A stored index was taken by its name alone: one copied over another document's (same length)
    served that document's landmarks with this one's pages, a wrong answer, and verify called it clean."""
    clean = answer(lm, tmp_path)
    (own,) = _indexes(tmp_path)
    other = torch.randint(0, 128, (len(IDS),), generator=torch.Generator().manual_seed(8)).tolist()
    with Session(SessionConfig.of(nvme_dir=tmp_path, **SETTINGS), loaded=lm) as session:
        session.complete([*other, 5, 6, 7], max_new_tokens=8)
    (copied,) = _indexes(tmp_path) - {own}
    os.replace(copied, own)
    (index,) = [i for i in verify(tmp_path).indexes if i.kind == "index"]
    assert index.problem == "named for other tokens than it holds (a file renamed, or copied over another's)"
    again = answer(lm, tmp_path)
    assert again.reused_tokens == 0 and again.tokens == clean.tokens      # prefilled again, and right
    assert verify(tmp_path).clean                                         # its own index written in its place
    answer(lm, tmp_path, prefill_budget=256)          # the same document under other settings (another identity)
    (theirs,) = _indexes(tmp_path) - {own}
    os.replace(theirs, own)
    third = answer(lm, tmp_path)
    assert third.reused_tokens == 0 and third.tokens == clean.tokens


def test_a_lost_journal_or_data_file_is_named_and_a_torn_tail_counted_in_records(tmp_path):
    """index.log removed beside a slots.dat that held blocks was "0 blocks, all sound / clean"; slots.dat
    removed was "the file was cut short"; a journal zeroed whole was "a last journal record cut short"."""
    store = tmp_path / "s"
    _six_blocks(store)
    journal = (store / "index.log").read_bytes()
    (store / "index.log").unlink()
    verdict = verify(tmp_path)
    assert not verdict.clean and "index.log is missing: the blocks slots.dat held are lost" in verdict.lines()[0]
    (store / "index.log").write_bytes(bytes(len(journal)))                  # zeroed: six records unreadable
    assert f"the journal's last {len(journal)} bytes (6 records) unreadable" in verify(tmp_path).lines()[0]
    (store / "index.log").write_bytes(journal)
    (store / "slots.dat").unlink()
    verdict = verify(tmp_path)
    assert not verdict.clean and "6 lost: slots.dat, the file that held them, is missing" in verdict.lines()[0]


def test_a_repair_with_other_settings_drops_no_block_of_a_store_whose_store_json_is_another_s(tmp_path):
    """Opened by a store.json of a larger block size, half the blocks lay past the data file's end, and
    the repair dropped them for good."""
    store = tmp_path / "kv-L2-H2-D16-T256-B1-float32"
    with NvmeTier(store, 4096, 8 * 4096, namespace=store.name) as tier:           # slots.dat: 8 blocks
        slots = [tier.pool.reserve() for _ in range(8)]
        tier.write([(BlockKey.of("m", i), slot, torch.full((4096,), i, dtype=torch.uint8))
                    for i, slot in enumerate(slots)])
    good = (store / "store.json").read_text()
    other = tmp_path / "elsewhere" / "kv-L2-H2-D16-T512-B1-float32"
    NvmeTier(other, 4 * 4096, 64 * 4 * 4096, namespace=other.name).close()
    (store / "store.json").write_text((other / "store.json").read_text())
    (line,) = verify(tmp_path, drop=True).lines()[:1]
    assert "store.json is another store's" in line and "nothing dropped" in line and "dropped:" not in line
    with NvmeTier(store, 4096, 8 * 4096, namespace=store.name) as tier:         # rebuilt: every block kept
        assert len(list(tier.items())) == 8
    assert json.loads((store / "store.json").read_text())["block_bytes"] == json.loads(good)["block_bytes"]
