"""Does a 1M-token document run on this machine, in how much memory, and is the passkey found?

Runs ``tierkv run`` as a child process per case (so its peak RSS is its own,
sampled with psutil every 0.2 s) and reads its ``--json`` result:

* the 1M-token run: sparse prefill + decode with a KV RAM budget of at most
  4 GiB (page tiers + the in-memory index), everything else on the NVMe store;
  its prefill saves a checkpoint every 5 minutes in ``--dir``, so running the
  bench again after an interruption resumes it (the prefill time adds up the runs);
  then a second decode from that store without overlap (``WAITING_1M``: each layer waits
  for all of its pages), and the store file's cold random-read rate, which bounds the
  page loads of both;
* passkey retrieval at 32K and 128K over several depths, sparse with remapped
  positions against dense attention (dense is measured where its prefill is
  affordable on this machine: 16K and 32K, the latter only in the full run).

``rss_vs_budget@1M`` = peak RSS / (4 GiB of KV + the RSS of the loaded model
and runtime with no KV, measured in its own child). ``--quick`` runs 32K
sparse and 12K dense at one depth (~10 min on 2 loaded cores: each case is a
real prefill, unless ``bench/decode.py`` stored it in the same ``--dir``).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from report import Help, Report, machine, out_file, random_read_rate
from tierkv.device import auto_dtype

GiB = 1024**3
KV_BUDGET = 4 * GiB
GPU, CPU = "256MiB", "512MiB"   # page tiers; the index (landmarks, outliers, window) comes on top
# the second decode from the stored 1M prefill: without overlap (the default attends to the pages in
# memory while the rest load), to show what overlap gives
WAITING_1M = ["--no-sparse-overlap"]
PAGE_TOKENS_1M = 32             # 1M tokens in 16-token pages: 2M blocks to look up and bookkeep (~110 B each)


LOG = Path(tempfile.gettempdir()) / "tierkv-scale-child.log"   # the running child's progress bar: tail it


def run_case(args: list[str]) -> tuple[dict, int, float]:
    """(``tierkv run --json`` result, peak RSS bytes, wall seconds) of one child run."""
    cmd = [sys.executable, "-m", "tierkv.cli", "run", "--json", *args]
    start = time.perf_counter()
    log = LOG.open("w")
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        proc = psutil.Process(child.pid)
        while not done.is_set():
            try:
                peak[0] = max(peak[0], proc.memory_info().rss)
            except psutil.Error:
                return
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = child.communicate()
    done.set()
    sampler.join()
    log.close()
    if child.returncode != 0:
        err = LOG.read_text(errors="replace").strip()[-2000:]
        raise RuntimeError(f"{' '.join(cmd[2:])} failed ({child.returncode}): {err}")
    return json.loads(out), peak[0], time.perf_counter() - start


def baseline_rss(dtype: str) -> int:
    """RSS of a process that loaded the model (in the runs' ``dtype``) and the runtime, with no KV."""
    code = ("import psutil, torch; from tierkv.model.loading import load_model; import tierkv.cli; "
            f"load_model('smollm2', dtype=torch.{dtype}); print(psutil.Process().memory_info().rss)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def scale_run(report: Report, tokens: int, store: Path, new_tokens: int, dtype: str) -> None:
    label = f"{tokens // 1024}K" if tokens < 2**20 else f"{tokens // 2**20}M"
    args = ["--synthetic-tokens", str(tokens), "--mode", "sparse", "--gpu-budget", GPU, "--cpu-budget", CPU,
            "--page-dtype", "bfloat16", "--nvme-dir", str(store), "--page-tokens", str(PAGE_TOKENS_1M),
            "--max-new-tokens", str(new_tokens), "--dtype", dtype]
    base = baseline_rss(dtype)
    result, peak, wall = run_case(args)
    s = result["sparse"]
    prefill_s = s["prefill_s_all_runs"] or result["prefill_s"]     # a stopped prefill resumes at its checkpoint
    report.add_row("sparse-remap", "prefill_s", prefill_s, "s", context=tokens, dtype=dtype)
    report.add_row("sparse-remap", "resumed_prefill_tokens", s["resumed_prefill_tokens"], "tokens",
                   context=tokens, dtype=dtype)
    peaks, found = [decode_rows(report, "sparse-remap", result, peak, wall, label, tokens, dtype, store)], [result["found"]]
    result, peak, wall = run_case(args + WAITING_1M)     # from the store the first run left
    peaks.append(decode_rows(report, "sparse-remap-no-overlap", result, peak, wall, label, tokens, dtype, store))
    found.append(result["found"])
    report.add_row("sparse-remap", "model_and_runtime_rss", base, "B", context=tokens, dtype=dtype)
    report.add_ratio(f"rss_vs_budget@{label}", round(max(peaks) / (KV_BUDGET + base), 3), 1.0,
                     "peak RSS / (4 GiB KV budget + RSS of model and runtime without KV), the larger of the two "
                     "runs", ceiling=True)
    report.add_ratio(f"passkey_found@{label}", float(all(found)), 1.0,
                     f"passkey found by sparse attention with remapped positions at {tokens} tokens, in both runs")
    report.add_bound(f"{label}: prefill {prefill_s:.0f} s over all runs = sparse prefill (exact for the first "
                     f"{s['dense_prefill_tokens']} tokens) of {tokens} tokens at {tokens / prefill_s:.0f} "
                     f"tok/s: each 1K-token chunk runs the model's weights and attends to ~{s['budget_tokens']} "
                     f"selected + 512 window tokens per KV head; the output says it is an approximation")


def decode_rows(report: Report, config: str, result: dict, peak: int, wall: float, label: str, tokens: int,
                dtype: str, store: Path) -> int:
    """One run's decode rows, its ratio and what bounds it; returns its peak RSS."""
    s, tiers = result["sparse"], result["tiers"]
    kv_ram = sum(tiers[t]["budget_bytes"] for t in ("gpu", "cpu")) + s["index_bytes"]
    rows = {"prefill_s_this_run": (result["prefill_s"], "s"),
            "decode_tokens_per_s": (result["decode_tokens_per_s"], "tok/s"),
            "stall_fraction": (result["stall_fraction"], ""), "peak_rss": (peak, "B"),
            "kv_ram_budget_used": (kv_ram, "B"), "index_bytes": (s["index_bytes"], "B"),
            "passkey_found": (int(bool(result["found"])), ""), "wall_s": (wall, "s")}
    for tier, t in tiers.items():
        rows[f"{tier}_peak"] = (t["peak_bytes"], "B")
        rows[f"{tier}_read"] = (t["bytes_read"], "B")
        rows[f"{tier}_read_answering"] = (t["answer_bytes_read"], "B")
    for metric, (value, unit) in rows.items():
        report.add_row(config, metric, value, unit, context=tokens, dtype=dtype)
    steps, page = max(1, result["generated_tokens"]), s["page_bytes"]
    loads = tiers["nvme"]["answer_bytes_read"] / page / steps        # the prefill's own reads left out
    report.add_ratio(f"decode_tok_s_{config.removeprefix('sparse-remap').strip('-') or 'default'}@{label}",
                     round(result["decode_tokens_per_s"], 3), 1.0 if config == "sparse-remap" else None,
                     f"{config}: decode tok/s from the stored prefill, {loads:.0f} page loads ({loads * page / 1e6:.0f} MB) "
                     f"from NVMe a token, stall {result['stall_fraction']:.2f}")
    rate = page_read_rate(next(store.glob(f"sparse-P{s['page_tokens']}-*/slots.dat"), None), page)
    step = 1 / result["decode_tokens_per_s"]
    report.add_bound(f"{config}@{label}: {loads:.0f} random {page // 1024} KiB page loads a token, {step:.2f} s a step "
                     f"of which {result['stall_fraction'] * step:.2f} s waited on them"
                     + (f"; cold random reads of the store's file ran at {rate / 1e3:.1f}K/s with 4 threads, "
                        f"{loads / rate:.2f} s for a token's loads (pages earlier runs read may come from the "
                        f"host's cache faster)" if rate else ""))
    return peak


def page_read_rate(path: Path | None, page_bytes: int, reads: int = 3000, threads: int = 4) -> float | None:
    """Random O_DIRECT reads of one page each over the store's slot file (cold: the file is far larger
    than any cache): reads per second. None without the file or O_DIRECT."""
    if path is None:
        return None
    slots, rng = path.stat().st_size // page_bytes, random.Random()   # other pages each call: none cached
    return random_read_rate(path, page_bytes, [rng.randrange(slots) * page_bytes for _ in range(reads)], threads)


def passkey(report: Report, tokens: int, depths: list[float], mode: str, store: Path,
            dtype: str) -> tuple[int, int]:
    found = 0
    for depth in depths:
        args = ["--synthetic-tokens", str(tokens), "--mode", mode, "--depth", str(depth), "--max-new-tokens", "12",
                "--gpu-budget", GPU, "--cpu-budget", "4GiB", "--dtype", dtype]
        if mode == "sparse":
            args += ["--nvme-dir", str(store), "--page-dtype", "bfloat16"]
        result, _, wall = run_case(args)
        ok = int(bool(result["found"]))
        found += ok
        report.add_row(f"{mode}{'-remap' if mode == 'sparse' else ''}", "passkey_found", ok, "", context=tokens,
                       dtype=dtype, depth=depth, answer=result["answer"], text=result["text"][:40], wall_s=round(wall))
    return found, len(depths)


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=Help)
    parser.add_argument("--quick", action="store_true", help="32K sparse + 12K dense, one depth each")
    parser.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "tierkv-scale",
                        help="NVMe store directory (the 1M run writes ~25 GB; default: tierkv-scale in the temp dir)")
    parser.add_argument("--cases", default="1m,passkey",
                        help="which parts, comma-separated: 1m (the 1M-token run; not with --quick), passkey (32K/128K "
                             "retrieval) (default 1m,passkey)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype of every run (auto: bf16 where the machine computes it natively, "
                             "fp32 elsewhere; tierkv info says which)")
    args = parser.parse_args(argv)
    dtype = str(auto_dtype()).removeprefix("torch.") if args.dtype == "auto" else args.dtype
    print(f"computing in {dtype}", file=sys.stderr)
    report = Report("scale", args.quick, machine(args.dir.parent if not args.dir.exists() else args.dir))
    start = time.perf_counter()
    store = args.dir
    cases = set(args.cases.split(","))
    if cases - {"1m", "passkey"}:
        parser.error(f"--cases {args.cases!r}: allowed: 1m, passkey")
    if "1m" in cases and not args.quick:
        scale_run(report, 2**20, store, 12, dtype)
    # depth 0.3 is bench/decode.py's sparse prompt: with the same --dir its stored prefill is reused here
    plan = {"sparse": {32768: [0.3]}, "dense": {12288: [0.3]}} if args.quick else \
        {"sparse": {32768: [0.3, 0.7], 131072: [0.3]}, "dense": {16384: [0.3]}}
    if "passkey" not in cases:
        plan = {}
    for mode, contexts in plan.items():
        for tokens, depths in contexts.items():
            found, total = passkey(report, tokens, depths, mode, store, dtype)
            report.add_ratio(f"passkey_{mode}@{tokens // 1024}K", found / total, 1.0 if mode == "sparse" else None,
                             f"share of depths where {mode} attention finds the passkey at {tokens} tokens")
    report.add_bound("dense attention over real positions leaves SmolLM2's trained window (8K) past 8K; "
                     "sparse runs remap every attended key into it (sinks, chosen chunks, window)")
    return report.finish(start, args.out)


if __name__ == "__main__":
    main()
