"""``tierkv batch``: summarize a JSONL file or a folder of documents with a planned offload schedule.

    tierkv batch --inputs docs/ --out summaries.jsonl --gpu-budget 2GiB --cpu-budget 8GiB \\
        --nvme-dir /mnt/nvme/tierkv --max-new-tokens 64

Prints the chosen policy and its predicted throughput, draws a progress bar (documents, tokens/s),
writes one JSON line per document (see tierkv.schedule.documents) and ends with the measured
throughput. Run it again after an interruption: finished documents are skipped. ``--ray [ADDRESS]``
runs the same job on a pool of Ray workers (tierkv.schedule.ray_job).
"""
from __future__ import annotations

import argparse
import json
import sys

from tierkv.errors import ConfigError
from tierkv.flags import path_arg
from tierkv.sizes import format_size, parse_size
from tierkv.model.prompt import DEFAULT_QUESTION
from tierkv.schedule.job import JobConfig, JobResult, run_job
from tierkv.schedule.policy import Policy

DEFAULTS = {"gpu_budget": "4GiB", "cpu_budget": "8GiB", "nvme_budget": "64GiB"}


def add_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="summarize many documents with a FlexGen-style offload schedule",
                       description="Summarize every document of a JSONL file or a folder. Weights and KV are "
                                   "placed on gpu/cpu/disk by a policy (searched for this machine, or a file) "
                                   "and streamed by a zig-zag block schedule. Output: one JSON line per "
                                   "document; rerunning resumes.")
    p.add_argument("--inputs", type=path_arg, required=True, metavar="PATH",
                   help="a .jsonl file (objects with 'text' and optional 'id') or a directory of text files")
    p.add_argument("--out", type=path_arg, required=True, metavar="FILE",
                   help="output JSONL (appended; finished ids are skipped)")
    p.add_argument("--model", default="smollm2", metavar="NAME|PATH",
                   help="smollm2 (default), a .gguf file or a HF folder")
    p.add_argument("--policy", default="auto", metavar="auto|FILE",
                   help="'auto' (searched on this machine within the budgets and --compress-kv) or a policy JSON "
                        "file, which places weights and KV itself (default auto)")
    p.add_argument("--gpu-budget", default=DEFAULTS["gpu_budget"], metavar="SIZE",
                   help=f"bytes on the compute device: resident weights, KV, activations (default {DEFAULTS['gpu_budget']})")
    p.add_argument("--cpu-budget", default=DEFAULTS["cpu_budget"], metavar="SIZE",
                   help=f"bytes of host memory for weights and KV (default {DEFAULTS['cpu_budget']})")
    p.add_argument("--nvme-dir", type=path_arg, metavar="DIR",
                   help="scratch directory on NVMe for weights/KV that fit nowhere else")
    p.add_argument("--nvme-budget", default=DEFAULTS["nvme_budget"], metavar="SIZE",
                   help="cap of the NVMe scratch (default 64GiB)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="summary length in tokens (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, metavar="N",
                   help="longer documents are reported as errors (default 2048)")
    p.add_argument("--instruction", default=DEFAULT_QUESTION, metavar="TEXT",
                   help=f"asked after each document (default: {DEFAULT_QUESTION!r})")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype; auto (default): bfloat16 on a GPU or a CPU that computes it natively (AMX, "
                        "AVX512-BF16), float32 elsewhere")
    p.add_argument("--weight-dtype", default=None, metavar="DTYPE",
                   help="keep streamed (cpu/disk) weights in bfloat16 or float16 and convert them as each layer "
                        "loads: half the bytes of fp32 in the tiers and on the links; lossless when the "
                        "checkpoint is in that dtype (default: the compute dtype, or the policy file's)")
    p.add_argument("--compress-kv", action="store_true", help="let the search store KV as int4 (keys per channel, values per token; tierkv.codec; lossy)")
    p.add_argument("--recalibrate", action="store_true", help="measure this machine again instead of the cache")
    p.add_argument("--retry-failed", action="store_true",
                   help="run again the documents whose line in --out says they failed while they ran ('failed: "
                        "...': a worker that died, an error); those that cannot run (empty, too long) stay as they are")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of the summary")
    ray = p.add_argument_group("Ray (pip install 'tierkv-runtime[ray]')")
    ray.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                     help="run the documents through a Ray Data pipeline of tierkv workers: 'local' (the default "
                          "when the flag has no value) starts Ray on this machine; an address joins a cluster "
                          "(`ray start --head` prints it; 'auto' finds the local one)")
    ray.add_argument("--workers", type=int, default=1, metavar="N",
                     help="tierkv workers (actors), each with its own model, tiers and budgets (default 1)")
    ray.add_argument("--cpus-per-worker", type=float, default=None, metavar="N",
                     help="cores per worker (default: the cluster's cores shared out)")
    ray.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="N", help="GPUs per worker (default 0)")
    ray.add_argument("--ray-batch", type=int, default=None, metavar="N",
                     help="documents per worker call, the unit a killed worker redoes (default: the documents "
                          "shared out among the workers, at most 64; each call plans its own schedule over them)")
    ray.add_argument("--ray-retries", type=int, default=3, metavar="N",
                     help="runs of a batch again after its worker died (default 3); a document that kills its "
                          "worker every time gets an error line")
    p.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.policy != "auto":            # a policy file places everything itself: these would be ignored
        searched = [flag for flag, value, default in (
            ("--gpu-budget", args.gpu_budget, DEFAULTS["gpu_budget"]), ("--cpu-budget", args.cpu_budget,
             DEFAULTS["cpu_budget"]), ("--nvme-budget", args.nvme_budget, DEFAULTS["nvme_budget"]),
            ("--compress-kv", args.compress_kv, False)) if value != default]
        if searched:
            raise ConfigError(f"{', '.join(searched)}: settings of the policy search, but --policy {args.policy} "
                              "places weights and KV itself; drop them, or use --policy auto to search within them")
    config = JobConfig(inputs=args.inputs, out=args.out, model=args.model, policy=args.policy,
                       gpu_budget=parse_size(args.gpu_budget, "--gpu-budget"),
                       cpu_budget=parse_size(args.cpu_budget, "--cpu-budget"), nvme_dir=args.nvme_dir,
                       nvme_budget=parse_size(args.nvme_budget, "--nvme-budget"),
                       max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                       instruction=args.instruction, dtype=args.dtype, recalibrate=args.recalibrate,
                       allow_compress=args.compress_kv, weight_dtype=args.weight_dtype, retry_failed=args.retry_failed)
    bar: list[tqdm] = []
    totals = {"tokens": 0, "seconds": 0.0}

    def on_policy(policy: Policy, predicted: float) -> None:
        if not args.json:
            print(f"policy: {policy.describe()}", file=sys.stderr)
            print(f"predicted {predicted:.2f} tok/s", file=sys.stderr)

    def progress(docs: int, tokens: int, seconds: float, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, unit="doc", desc="batch", file=sys.stderr, dynamic_ncols=True,
                            disable=args.json))
        totals["tokens"] += tokens
        totals["seconds"] += seconds
        if totals["seconds"]:
            bar[0].set_postfix_str(f"{totals['tokens'] / totals['seconds']:.1f} tok/s", refresh=False)
        bar[0].update(docs)

    if args.ray is None:
        ray_only = [flag for flag, value, default in (
            ("--workers", args.workers, 1), ("--cpus-per-worker", args.cpus_per_worker, None),
            ("--gpus-per-worker", args.gpus_per_worker, 0.0), ("--ray-batch", args.ray_batch, None),
            ("--ray-retries", args.ray_retries, 3)) if value != default]
        if ray_only:
            raise ConfigError(f"{', '.join(ray_only)}: Ray settings, but no --ray (add --ray to run on Ray workers)")
    try:
        if args.ray is not None:
            from tierkv.schedule.ray_job import RayOptions, run_ray_job
            options = RayOptions(args.ray, args.workers, args.cpus_per_worker, args.gpus_per_worker, args.ray_batch,
                                 args.ray_retries)
            result = run_ray_job(config, options, progress=progress)
        else:
            result = run_job(config, progress=progress, on_policy=on_policy)
    except KeyboardInterrupt:
        for b in bar:
            b.close()
        print(f"tierkv batch: stopped; the documents finished are in {args.out}: the same command again "
              "goes on with the rest", file=sys.stderr)
        raise
    finally:
        for b in bar:
            b.close()
    _report(result, args)
    if result.failed:              # every line is written; a script still learns that some are errors
        print(f"tierkv batch: {result.failed} document(s) failed; their lines in {args.out} say why "
              "(--retry-failed runs again those that failed while they ran)", file=sys.stderr)
        return 1
    return 0


def _report(r: JobResult, args: argparse.Namespace) -> None:
    summary = {"out": str(args.out), "documents": r.documents, "failed": r.failed, "skipped": r.skipped,
               "generated_tokens": r.generated_tokens, "seconds": round(r.seconds, 3),
               "tokens_per_s": round(r.tokens_per_s, 3),
               "predicted_tokens_per_s": None if r.predicted_tokens_per_s is None else round(r.predicted_tokens_per_s, 3),
               "policy": None if r.policy is None else r.policy.to_dict(),
               "memory_bytes": {k: int(v) for k, v in r.memory.items()}}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{r.documents} documents written to {args.out} ({r.failed} failed, {r.skipped} already done)")
    if args.ray is not None and r.seconds:
        planned = "each searching its own policy" if args.policy == "auto" else f"policy {args.policy}"
        print(f"ray {args.ray}, {args.workers} worker(s), {planned}: {r.generated_tokens} tokens "
              f"in {r.seconds:.1f} s ({r.tokens_per_s:.2f} tok/s, {r.documents / r.seconds:.3f} documents/s, "
              f"model loads and prefill included)")
    if r.policy is not None:
        print(f"policy: {r.policy.describe()}")
        print(f"throughput: measured {r.tokens_per_s:.2f} tok/s ({r.generated_tokens} tokens in {r.seconds:.1f} s, "
              f"prefill included), predicted {r.predicted_tokens_per_s:.2f} tok/s")
        print("memory (predicted): " + ", ".join(f"{k} {format_size(v)}" for k, v in r.memory.items()))
