"""What a damaged page of a stored long document costs: a repair against a full re-prefill.

Per context: a real-text document (``pydoc_data``) of about CTX tokens read in sparse mode with
SmolLM2 into an NVMe store in a scratch directory (the prefill: timed, restore points saved as a
run saves them); then one page, drawn at random, gets high-order bytes flipped on disk; then
``tierkv store repair`` does what a run that met the page would do (scrub the document's pages,
replay the prefill from the restore point before the page until it is sealed again)::

    repair_vs_prefill@CTX    seconds of the repair (scrub + replay) / seconds of the prefill

    python bench/repair.py --quick --out bench/out/repair-quick.json     32K
    python bench/repair.py --out bench/out/repair.json                   128K
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from report import Help, Report, machine, out_file, stop_on_sigterm
from reuse import BUDGETS, document
from tierkv.keys import BlockKey
from tierkv.model.loading import load_model
from tierkv.model.settings import SessionConfig
from tierkv.session import Session
from tierkv.session.scrub import repair_store, verify
from tierkv.sparse.restore import restore_points, spacing
from tierkv.tiers.nvme import NvmeTier

TARGET = 0.1


def damage_one_page(store: Path, rng: random.Random) -> tuple[int, int]:
    """Flip high-order bytes in one page of the stored document; (layer, page)."""
    (index,) = [p for p in (store / "sparse-indexes").glob("*.safetensors")
                if ".restore-" not in p.name and ".partial" not in p.name]
    from safetensors import safe_open
    with safe_open(str(index), framework="pt") as f:
        pages = json.loads(f.metadata()["pages"])
    root = BlockKey(bytes.fromhex(index.name.split(".")[0].split("-")[2]))
    layer = rng.randrange(len(pages))
    page = rng.randrange(pages[layer])
    (directory,) = store.glob("sparse-P*")
    with NvmeTier.existing(directory) as tier:
        slot, block_bytes = tier.lookup(BlockKey.of(root.digest, "page", layer, page)), tier.block_bytes
    with open(directory / "slots.dat", "r+b") as f:
        for _ in range(16):
            at = slot * block_bytes + rng.randrange(block_bytes // 2) * 2 + 1   # a bf16 or fp32 high byte
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x40]))
    return layer, page


def measure(report: Report, loaded, ctx: int, scratch: Path) -> None:
    label, store = f"{ctx // 1024}K", scratch / f"sparse-{ctx}"
    config = SessionConfig.of(mode="sparse", nvme_dir=store, **BUDGETS)
    progress(f"{label}: prefill")
    with Session(config, loaded=loaded) as session:
        tokens = session.read(document(loaded.tokenizer, ctx))
        prefill_s = session.document_s
    layer, page = damage_one_page(store, random.Random(ctx))
    progress(f"{label}: page {page} of layer {layer} damaged; repair")
    start = time.perf_counter()
    verdict = repair_store(store, config, loaded=loaded)
    total_s = time.perf_counter() - start
    (index,) = [i for i in verdict.indexes if i.kind == "index"]
    fixed = index.repair
    if fixed is None or not verify(store).clean:
        raise SystemExit(f"{label}: the repair did not leave a clean store: {verdict.lines()}")
    points = restore_points(index.path)
    restore_bytes = sum(path.stat().st_size for _, path in points)
    (pages_dir,) = store.glob("sparse-P*")
    config_name = f"sparse@{label}"
    report.add_row(config_name, "prefill_s", round(prefill_s, 1), "s", tokens=tokens)
    report.add_row(config_name, "repair_s", round(fixed.seconds, 2), "s", pages=fixed.pages, replayed=fixed.tokens,
                   start=fixed.start, scrubbed=fixed.scrubbed, scrub_s=round(fixed.scrub_s, 2),
                   restore_points=len(points))
    report.add_row(config_name, "restore_points_bytes", restore_bytes, "B", index=index.path.stat().st_size,
                   pages=(pages_dir / "slots.dat").stat().st_size)
    report.add_row(config_name, "store_repair_command_s", round(total_s, 2), "s")
    report.add_ratio(f"repair_vs_prefill@{label}", round(fixed.seconds / prefill_s, 4), TARGET,
                     "seconds to repair one damaged page (scrub every page, replay from the restore point before "
                     "it) / seconds of the document's prefill", ceiling=True)
    report.add_bound(f"{config_name}: the replay ran {fixed.tokens} of {tokens} tokens from token {fixed.start} "
                     f"(restore points every {spacing(tokens)} tokens: {len(points)}); the scrub read {fixed.scrubbed} "
                     f"pages; `tierkv store repair` in all (a verify pass, model load, the repair): {total_s:.1f} s")


def progress(text: str) -> None:
    print(f"[repair] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Help)
    p.add_argument("--quick", action="store_true", help="32K only (about 5 minutes on 2 cores)")
    p.add_argument("--contexts", default=None, help="contexts in K tokens (default 128; quick 32)")
    p.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    args = p.parse_args(argv)
    stop_on_sigterm()
    contexts = [int(x) * 1024 for x in (args.contexts or ("32" if args.quick else "128")).split(",") if x]
    start, scratch = time.perf_counter(), Path(tempfile.mkdtemp(prefix="tierkv-bench-repair-"))
    report = Report("repair", args.quick, machine(scratch))
    try:
        loaded = load_model("smollm2")
        for ctx in contexts:
            measure(report, loaded, ctx, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report.finish(start, args.out)


if __name__ == "__main__":
    main()
