"""The ``tierkv`` command: one sub-command per user job, registered in COMMANDS.

Errors a user can fix (bad flags, bad sizes, a missing file, a full disk)
print one line and exit 2; no traceback.
"""
from __future__ import annotations

import os

# Idle OpenMP workers spin by default; on a small machine that starves the I/O and event-loop
# threads the compute waits on (measured: a reused 4K prompt's recomputed chunk took 6-9 s of CPU
# instead of 3.7 s). Must be set before torch loads; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from tierkv.sizes import format_size
from tierkv.device import has_cuda, has_cuda_driver
from tierkv.errors import ConfigError, TierKVError
from tierkv.profile.command import add_profile
from tierkv.tune.tune import add_tune
from tierkv.schedule.command import add_batch


class UsageError(TierKVError):
    """A command-line mistake: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + traceback
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


# -- tierkv info ------------------------------------------------------------
def machine_facts(nvme_dir: Path | None) -> dict[str, object]:
    facts: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "ram_available_bytes": psutil.virtual_memory().available,
        "cuda": torch.cuda.get_device_name(0) if has_cuda() else None,
        "cuda_driver": has_cuda_driver(),
        "pinned_memory": has_cuda(),
        "gds": _gds_status(),
    }
    if nvme_dir is not None:
        facts["nvme"] = _nvme_facts(nvme_dir)
    return facts


def _gds_status() -> str:
    if not has_cuda_driver():
        return "unavailable: no CUDA driver (libcuda.so.1)"
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return "unavailable: kvikio not installed (pip install 'tierkv[gds]')"
    return "available"


def _nvme_facts(directory: Path) -> dict[str, object]:
    from tierkv.tiers.nvme_io import o_direct_supported, probe_backends
    probe_dir = directory if directory.exists() else _existing_parent(directory)
    usage = shutil.disk_usage(probe_dir)
    return {
        "dir": str(directory),
        "free_bytes": usage.free,
        "o_direct": o_direct_supported(probe_dir),
        "backends": probe_backends(probe_dir),
    }


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _print_facts(facts: dict[str, object]) -> None:
    print(f"python {facts['python']}, torch {facts['torch']}, {facts['threads']} threads, {facts['cpu']}")
    print(f"RAM        {format_size(facts['ram_bytes'])} ({format_size(facts['ram_available_bytes'])} available)")
    print(f"CUDA       {facts['cuda'] or 'none (gpu tier runs in host memory under its budget)'}")
    print(f"pinned     {'yes' if facts['pinned_memory'] else 'no (needs CUDA)'}")
    print(f"GDS        {facts['gds']}")
    nvme = facts.get("nvme")
    if nvme:
        print(f"NVMe dir   {nvme['dir']}: {format_size(nvme['free_bytes'])} free, "
              f"O_DIRECT {'yes' if nvme['o_direct'] else 'no'}")
        for name, status in nvme["backends"].items():
            print(f"  backend {name:9s} {status}")
    if "links" in facts:
        from tierkv.profile.probe import link_lines
        print(f"links      measured {facts['links']['measured_at']} ({'quick' if facts['links']['quick'] else 'full'})")
        for line in link_lines(facts["links"]):
            print(f"  {line}")


def cmd_info(args: argparse.Namespace) -> int:
    facts = machine_facts(args.nvme_dir)
    if args.probe or args.reprobe:
        from tierkv.profile.probe import probe_links
        facts["links"] = probe_links(args.nvme_dir, quick=not args.full, refresh=args.reprobe)
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        _print_facts(facts)
    return 0


def add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="what this machine offers: CUDA, GDS, pinned memory, NVMe backends")
    p.add_argument("--nvme-dir", type=Path, help="directory to probe for the NVMe tier")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--probe", action="store_true",
                   help="measure memcpy, device-link and disk (--nvme-dir) GB/s and latency; cached")
    p.add_argument("--reprobe", action="store_true", help="like --probe, measuring again instead of the cache")
    p.add_argument("--full", action="store_true", help="with --probe: a longer, steadier measurement")
    p.set_defaults(func=cmd_info)


# -- tierkv run --------------------------------------------------------------
def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a model over a long document with its KV spilled across tiers",
                       description="Prefill a long prompt chunk by chunk with the KV in gpu/cpu/NVMe tiers, "
                                   "then generate. A second run over the same document reuses the stored KV.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--doc", type=Path, help="a text file; the question is asked after it")
    source.add_argument("--synthetic-tokens", type=int, metavar="N",
                        help="a reproducible N-token haystack with a planted passkey, and ask for it")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf file or a HF folder")
    p.add_argument("--question", help="question asked after --doc (default: summarize)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--config", type=Path, help="settings file written by `tierkv tune` (flags given here win)")
    p.add_argument("--gpu-budget", help=f"KV bytes in the compute device's tier (default {RUN_DEFAULTS['gpu_budget']})")
    p.add_argument("--cpu-budget", help=f"KV bytes in host memory (default {RUN_DEFAULTS['cpu_budget']})")
    p.add_argument("--nvme-dir", type=Path, help="directory of the persistent NVMe store (enables reuse)")
    p.add_argument("--nvme-budget", help=f"cap of the NVMe store; cold blocks are evicted "
                                         f"(default {RUN_DEFAULTS['nvme_budget']})")
    p.add_argument("--cxl-budget", help="bytes of a simulated CXL memory pool between cpu and nvme (default: none)")
    p.add_argument("--cxl-preset", help="the pool's link: cxl2-x8 (default), cxl2-x16, cxl2-x8x4, cmm-b")
    for tier in ("gpu", "cpu", "nvme"):
        p.add_argument(f"--{tier}-policy", help=f"eviction policy of the {tier} tier: a name in policies "
                                                f"or module:Class (default lru)")
    p.add_argument("--prefetch", help="which blocks of the next layer to load ahead: a policies.prefetch "
                                      "name (default next-layer)")
    p.add_argument("--mode", default="auto", choices=("auto", "dense", "sparse"),
                   help="dense: attend to every stored key; sparse: ShadowKV-style top-k chunks; auto "
                        "(default): sparse past the model's trained window, dense within it")
    sparse = p.add_argument_group("sparse mode")
    sparse_flags = [
        sparse.add_argument("--sparse-budget", default="2048", metavar="N|P%",
                            help="selected tokens per KV head and step: a count (default 2048) or a share like 2%%"),
        sparse.add_argument("--layer-budget", default="", metavar="L:N[;L:N]",
                            help="decode budgets of single layers, like 0:6144 (layer 0 attends broadly: at "
                                 "16K its best 2048 tokens hold 60%% of its attention); default: none"),
        sparse.add_argument("--layer-allocation", default="uniform", choices=("uniform", "adaptive"),
                            help="uniform (default): every layer the same budget; adaptive: move it between "
                                 "layers at the same total, by coverage estimated from the landmarks (it "
                                 "raised coverage but lowered agreement with dense on SmolLM2 at 8K)"),
        sparse.add_argument("--sparse-attend", default="pages", choices=("pages", "chunks"),
                            help="pages (default): each KV head also attends other chunks of the pages its "
                                 "step read, up to twice its own selection (a page holds every head's tokens: "
                                 "no extra read, more of the attention covered); chunks: each head only the "
                                 "chunks it selected"),
        sparse.add_argument("--prefill-budget", default="1024", metavar="N|P%",
                            help="the same for each chunk of a sparse prefill (default 1024)"),
        sparse.add_argument("--rank", type=int, help="rank of the low-rank keys (default: full up to 256 key "
                                                     "dimensions, else 160 per 1024, at least 128)"),
        sparse.add_argument("--selector", default="shadowkv",
                            help="chunk selector: shadowkv (landmarks, default), quest (page bounds), near-memory "
                                 "(scored in a simulated CXL pool), or module:Class"),
        sparse.add_argument("--sparse-prefetch", default="none",
                            help="what to load for layer l+1 during layer l: none (default: sparse decode computes "
                                 "on the CPU, where a guess costs more than it hides), speculative, previous-step"),
        sparse.add_argument("--sparse-overlap", action="store_true",
                            help="decode: attend to the pages already in memory while the rest load from NVMe, "
                                 "then to those (an exact merge); hides the loads where compute has cores of its "
                                 "own, costs throughput where it shares them (2 CPU cores, 128K: stall under "
                                 "2 %%, 0-8 %% fewer tokens/s)"),
        sparse.add_argument("--positions", default="auto", choices=("auto", "original", "remap"),
                            help="RoPE positions of attended keys: remap = compact positions inside the trained "
                                 "window (default past it), original = real positions"),
        sparse.add_argument("--dense-prefill-tokens", type=int, metavar="N",
                            help="prefill exactly up to N tokens, sparsely after (default: the whole prompt "
                                 "within the trained window, half the window past it)"),
        sparse.add_argument("--page-dtype", choices=("float32", "bfloat16", "float16"),
                            help="dtype of the stored values and key factors (default: the model's --dtype)"),
        sparse.add_argument("--page-tokens", type=int, default=16, metavar="N",
                            help="tokens per stored page, a multiple of 8 (default 16; 32 past ~500K tokens halves "
                                 "the ~0.8 KiB of bookkeeping the tier manager keeps per page)"),
    ]
    p.set_defaults(sparse_flags={a.dest: (a.option_strings[0], a.default) for a in sparse_flags})
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per KV block")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="prefill chunk (a multiple of the block)")
    p.add_argument("--no-reuse", action="store_true", help="ignore KV stored by earlier runs")
    p.add_argument("--checkpoint-every", type=float, default=300.0, metavar="SECONDS",
                   help="sparse mode with --nvme-dir: save a long prefill's state this often, so a stopped "
                        "run resumes there (default 300; 0: never)")
    p.add_argument("--depth", type=float, default=0.5, help="passkey depth in [0, 1]")
    p.add_argument("--seed", type=int, default=0, help="passkey seed")
    p.add_argument("--filler", default="repeat", help="haystack filler: repeat (default) or text")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON of every transfer and wait")
    p.add_argument("--record-access", type=Path, metavar="FILE",
                   help="write an access trace (which blocks each step and layer read) for tierkv tune")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.set_defaults(func=cmd_run)


RUN_DEFAULTS = {"gpu_budget": "256MiB", "cpu_budget": "1GiB", "nvme_budget": "64GiB", "cxl_budget": "0",
                "cxl_preset": "cxl2-x8", "gpu_policy": "lru",
                "cpu_policy": "lru", "nvme_policy": "lru", "prefetch": "next-layer"}


def run_settings(args: argparse.Namespace) -> dict[str, object]:
    """Budgets, policies and prefetch: a flag given, else ``--config``, else the default."""
    from tierkv.tune.tune import read_run_config
    chosen = RUN_DEFAULTS | (read_run_config(args.config) if args.config else {})
    return {key: value if getattr(args, key) is None else getattr(args, key) for key, value in chosen.items()}


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tierkv.model.generate import RunConfig, run
    sparse_given = [flag for dest, (flag, default) in args.sparse_flags.items() if getattr(args, dest) != default]
    if sparse_given and args.mode == "dense":
        raise ConfigError(f"{', '.join(sparse_given)}: sparse-mode settings, but --mode dense attends to every "
                          "stored key; drop them, or use --mode sparse (or auto: sparse past the trained window)")
    config = RunConfig(model=args.model, doc=args.doc, synthetic_tokens=args.synthetic_tokens,
                       question=args.question, max_new_tokens=args.max_new_tokens,
                       nvme_dir=args.nvme_dir, **run_settings(args), mode=args.mode, dtype=args.dtype,
                       sparse_budget=args.sparse_budget, layer_budgets=args.layer_budget,
                       layer_allocation=args.layer_allocation, sparse_attend=args.sparse_attend,
                       prefill_budget=args.prefill_budget, rank=args.rank,
                       selector=args.selector,
                       sparse_prefetch=args.sparse_prefetch, sparse_overlap=args.sparse_overlap,
                       positions=args.positions,
                       dense_prefill_tokens=args.dense_prefill_tokens, page_dtype=args.page_dtype,
                       page_tokens=args.page_tokens,
                       block_tokens=args.block_tokens, chunk_tokens=args.chunk_tokens,
                       reuse=not args.no_reuse, checkpoint_s=args.checkpoint_every,
                       depth=args.depth, seed=args.seed, filler=args.filler,
                       trace=args.trace, record_access=args.record_access)
    bars: list[tqdm] = []

    def on_prefill(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, dynamic_ncols=True))
        bars[0].update(done - bars[0].n)
        if done >= total:
            bars[0].close()  # before the answer streams out

    def on_text(piece: str) -> None:
        if not args.json:
            print(piece, end="", flush=True)

    try:
        result = run(config, on_text=on_text, on_prefill=on_prefill)
    finally:
        for bar in bars:
            bar.close()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print()
        _print_run_summary(result, config)
        if sparse_given and result.mode != "sparse":
            print(f"note: {', '.join(sparse_given)} unused: --mode auto ran dense, the prompt being within the "
                  "model's trained window; --mode sparse applies them")
    return 0


def _print_run_summary(r, config) -> None:
    print(f"\nprompt {r.prompt_tokens} tokens (KV {format_size(r.kv_bytes)}), reused {r.reused_prompt_tokens}; "
          f"prefill {r.prefill_s:.1f} s, first token after {r.ttft_s:.1f} s")
    print(f"decode {r.generated_tokens} tokens at {r.decode_tokens_per_s:.2f} tok/s, "
          f"stall {100 * r.stall_fraction:.1f} % of decode time")
    if r.mode == "sparse":
        _print_sparse_summary(r.sparse)
    if r.answer is not None:
        print(f"passkey {r.answer}: {'found' if r.found else 'NOT found'} in the output")
    print(f"{'tier':6s} {'budget':>10s} {'peak':>10s} {'final':>10s} {'read':>10s} {'written':>10s}  backend")
    for name, t in r.tiers.items():
        print(f"{name:6s} {format_size(t['budget_bytes']):>10s} {format_size(t['peak_bytes']):>10s} "
              f"{format_size(t['final_bytes']):>10s} {format_size(t['bytes_read']):>10s} "
              f"{format_size(t['bytes_written']):>10s}  {t['backend']}")
    if config.trace:
        print(f"trace written to {config.trace}: open it in ui.perfetto.dev, or `tierkv profile {config.trace}`")


def _print_sparse_summary(s: dict) -> None:
    lo, hi = min(s["layer_tokens"], default=0), max(s["layer_tokens"], default=0)
    spread = f" ({lo}-{hi} by layer in the last step, {s['allocation']})" if lo != hi else ""
    print(f"sparse: {s['budget_tokens']} tokens per KV head{spread} by {s['selector']}, rank {s['rank']}, "
          f"positions {s['positions']}, prefetch {s['prefetch']}{', overlap' if s['overlap'] else ''}; "
          f"{s['tokens_per_layer_step']:.0f} tokens "
          f"attended per layer beside sinks and window (attend {s['attend']}); pages reused from the previous step "
          f"{100 * s['reuse_rate']:.0f} %; index in memory {format_size(s['index_bytes'])}")
    if s["resumed_prefill_tokens"]:
        print(f"resumed a stopped prefill at token {s['resumed_prefill_tokens']}; its prefill took "
              f"{s['prefill_s_all_runs']:.0f} s over all runs")
    if s["approximate_prefill"]:
        print(f"note: prefill was exact for the first {s['dense_prefill_tokens']} tokens and sparse after "
              f"(an approximation; --dense-prefill-tokens N prefills more exactly, at quadratic cost)")


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_info, add_run, add_profile, add_tune, add_batch]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierkv", description="Tiered KV-cache offloading runtime for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (TierKVError, OSError) as error:
        print(f"tierkv: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tierkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
