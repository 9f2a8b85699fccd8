"""Past one process: is a remote hit faster than prefilling, and what does the Ray pipeline cost?

One run, rows measured side by side:

    remote-prefill      tierkv run, dense, empty local store, a redis-server started here: prefill and
                        write every block through to Redis (TTFT)
    remote-hit          the same prompt in a new process-like run with an empty local store: every
                        block but the last's from Redis (TTFT)
    single-process      tierkv batch over the same documents, one process (documents/s, wall time of
                        the command: model load, calibration and search included)
    ray-1 / ray-2       tierkv batch --ray local with 1 and 2 workers, the same documents (wall time
                        of the command: Ray's start, the workers' model loads, calibrations included)

    python bench/scale_out.py --quick --out scale_out.json     (about 4 minutes on 2 cores)
    python bench/scale_out.py --out scale_out.json             (8K remote rows, 96 documents; about 10 minutes)
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import Help, Report, machine, out_file, stop_on_sigterm
from tierkv.model.loading import load_model
from tierkv.model.settings import RunConfig
from tierkv.session.run import run

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from redis_process import RedisServer  # noqa: E402

TARGETS = {"remote_hit_ttft_vs_prefill": 0.2, "ray_vs_single_process": 0.9}


def remote_rows(report: Report, tokens: int, scratch: Path) -> None:
    server = RedisServer(scratch).start()
    loaded = load_model("smollm2")
    try:
        flags = dict(synthetic_tokens=tokens, mode="dense", max_new_tokens=4, remote=server.url,
                     gpu_budget="1GiB", cpu_budget="1GiB")
        section = f"remote tier: SmolLM2 fp32, dense, {tokens // 1024}K-token prompt, redis-server on this machine"
        cold = run(RunConfig.of(**flags), loaded=loaded)
        hit = run(RunConfig.of(**flags), loaded=loaded)
        for name, r in (("remote-prefill", cold), ("remote-hit", hit)):
            report.add_row(name, "ttft_s", round(r.ttft_s, 3), "s", section=section,
                           reused_tokens=r.reused_prompt_tokens, remote_read_bytes=r.remote["read_bytes"],
                           remote_written=r.remote["written"], text_same=hit.text == cold.text)
        report.add_ratio(f"remote_hit_ttft_vs_prefill@{tokens // 1024}K", round(hit.ttft_s / cold.ttft_s, 3),
                         TARGETS["remote_hit_ttft_vs_prefill"],
                         "TTFT with every whole block read from Redis / TTFT computing them (same run; lower is better)",
                         ceiling=True)
        link = hit.remote["link"]
        report.add_bound(f"{section}: {hit.remote['read_bytes'] / 2**20:.0f} MiB read from Redis "
                         f"({link['bytes_per_s'] / 1e9:.2f} GB/s, round trip {link['rtt_s'] * 1e3:.2f} ms); what is "
                         f"left of the hit's TTFT is the last block's {cold.prompt_tokens - hit.reused_prompt_tokens} "
                         f"tokens and the first decode step")
    finally:
        server.kill()


def documents(folder: Path, n: int) -> Path:
    from pydoc_data.topics import topics
    folder.mkdir(parents=True)
    names = sorted(topics, key=lambda k: len(topics[k]))
    for i in range(n):
        name = names[int(i * (len(names) - 1) / max(1, n - 1) * 0.6)]
        (folder / f"{i:03d}-{name}.txt").write_text(topics[name][:3000])
    return folder


def batch(folder: Path, out: Path, *extra: str) -> dict:
    out.unlink(missing_ok=True)
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tierkv.cli", "batch", "--inputs", str(folder), "--out", str(out),
                           "--max-new-tokens", "16", "--dtype", "float32", "--json", *extra],  # (auto: bf16 with AMX)
                          capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode:
        raise RuntimeError(f"tierkv batch {' '.join(extra)} failed: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout)
    return {"wall_s": wall, "documents": summary["documents"], "docs_per_s": summary["documents"] / wall,
            "work_s": summary["seconds"],
            "outputs": {json.loads(line)["id"]: json.loads(line).get("summary") for line in out.read_text().splitlines()}}


def ray_rows(report: Report, n: int, scratch: Path) -> None:
    folder = documents(scratch / "docs", n)
    section = f"batch: SmolLM2 fp32, {n} documents of CPython's docs (at most 3000 characters), 16 new tokens"
    single = batch(folder, scratch / "single.jsonl")
    rows = {"single-process": single}
    for workers in (1, 2):
        rows[f"ray-{workers}"] = batch(folder, scratch / f"ray{workers}.jsonl", "--ray", "local", "--workers",
                                       str(workers))
    for name, r in rows.items():
        report.add_row(name, "documents_per_s", round(r["docs_per_s"], 4), "doc/s", section=section,
                       wall_s=round(r["wall_s"], 1), work_s=round(r["work_s"], 1),
                       same_as_single=r["outputs"] == single["outputs"])
    report.add_ratio("ray_vs_single_process", round(rows["ray-1"]["docs_per_s"] / single["docs_per_s"], 3),
                     TARGETS["ray_vs_single_process"],
                     "documents/s of tierkv batch --ray local with one worker / plain tierkv batch, same documents, "
                     "each the wall time of the whole command")
    report.add_bound(f"{section}: wall_s is the whole command; work_s the generation alone (one process: its blocks; "
                     f"Ray: from the pipeline's start to its last record, the workers' model loads included). The Ray "
                     f"rows also start and stop a local Ray instance; two workers on 2 cores split the same cores "
                     f"(one thread each)")


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Help)
    p.add_argument("--quick", action="store_true", help="a 4K remote prompt, 24 documents")
    p.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    p.add_argument("--skip", choices=("remote", "ray"), action="append", default=[], help="leave a part out")
    args = p.parse_args(argv)
    stop_on_sigterm()
    start, scratch = time.perf_counter(), Path(tempfile.mkdtemp(prefix="tierkv-bench-scale-out-"))
    report = Report("scale_out", args.quick, machine(scratch))
    try:
        if "remote" not in args.skip:
            remote_rows(report, 4096 if args.quick else 8192, scratch)
        if "ray" not in args.skip:
            ray_rows(report, 24 if args.quick else 96, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report.finish(start, args.out)


if __name__ == "__main__":
    main()
