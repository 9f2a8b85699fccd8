"""``tierkv info``: what this machine offers tierkv (CUDA, GDS, pinned memory, the compute dtype ``auto``
picks, the NVMe directory's backends), and on request its links measured (``--probe``) and a remote
store's server (``--remote``)."""
from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
from pathlib import Path

import psutil
import torch

from tierkv.device import GDS_INSTALL, auto_dtype, has_cuda, has_cuda_driver, native_bf16
from tierkv.errors import ConfigError
from tierkv.flags import path_arg
from tierkv.knobs import IOKnobs
from tierkv.sizes import format_size


def machine_facts(nvme_dir: Path | None) -> dict[str, object]:
    from tierkv.model.arch import packs_weights
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
        "native_bf16": native_bf16(),
        "auto_dtype": str(auto_dtype()).removeprefix("torch."),
        "packed_decode_weights": packs_weights(torch.bfloat16),
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
        return f"unavailable: kvikio not installed ({GDS_INSTALL})"
    return "available"


def _nvme_facts(directory: Path) -> dict[str, object]:
    from tierkv.tiers import nvme_aio
    from tierkv.tiers.nvme_io import o_direct_supported, probe_backends
    probe_dir = directory if directory.exists() else _existing_parent(directory)
    usage = shutil.disk_usage(probe_dir)
    o_direct = o_direct_supported(probe_dir)
    return {
        "dir": str(directory),
        "exists": directory.is_dir(),
        "probed_in": str(probe_dir),    # a missing directory's nearest existing parent, where a run would make it
        "free_bytes": usage.free,
        "o_direct": o_direct,
        "backends": probe_backends(probe_dir),
        "native_aio_reads": o_direct and nvme_aio.available() and IOKnobs.from_env().nvme_aio,
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
    native = facts["native_bf16"]
    print(f"dtype      --dtype auto computes in {facts['auto_dtype']} "
          f"({f'bf16 native: {native}' if native else 'no AMX, AVX512-BF16 or CUDA: bf16 would be emulated'})")
    if facts["packed_decode_weights"]:
        print("weights    a bf16 model's decode rows use copies laid out for oneDNN (TIERKV_PACKED_WEIGHTS=0: off)")
    nvme = facts.get("nvme")
    if nvme:
        if not nvme["exists"]:
            print(f"NVMe dir   {nvme['dir']}: does not exist yet; a run makes it in {nvme['probed_in']}, "
                  "whose file system the lines below describe")
        print(f"NVMe dir   {nvme['dir']}: {format_size(nvme['free_bytes'])} free, "
              f"O_DIRECT {'yes' if nvme['o_direct'] else 'no'}, reads by native AIO "
              f"{'yes' if nvme['native_aio_reads'] else 'no (on the I/O worker threads)'}")
        for name, status in nvme["backends"].items():
            print(f"  backend {name:9s} {status}")
    remote = facts.get("remote")
    if remote and remote["reachable"]:
        cap = format_size(remote["maxmemory"]) if remote.get("maxmemory") else "no maxmemory (tierkv's TTL bounds it)"
        print(f"remote     {remote['url']}: server {remote.get('version')}, {format_size(remote['used_memory'] or 0)} "
              f"used, cap {cap} ({remote.get('maxmemory_policy')}); round trip "
              f"{remote['rtt_s'] * 1e3:.2f} ms, read {remote['read_bytes_per_s'] / 1e9:.2f} GB/s")
    elif remote:
        print(f"remote     {remote['url']}: UNREACHABLE ({remote['error']})")
    if "links" in facts:
        from tierkv.profile.probe import link_lines
        print(f"links      measured {facts['links']['measured_at']} ({'quick' if facts['links']['quick'] else 'full'})")
        for line in link_lines(facts["links"]):
            print(f"  {line}")


def cmd_info(args: argparse.Namespace) -> int:
    if args.full and not (args.probe or args.reprobe):
        raise ConfigError("--full: a longer link measurement, so it goes with --probe or --reprobe")
    if args.nvme_dir is not None and args.nvme_dir.exists() and not args.nvme_dir.is_dir():
        raise ConfigError(f"--nvme-dir {args.nvme_dir}: not a directory")
    facts = machine_facts(args.nvme_dir)
    if args.probe or args.reprobe:
        from tierkv.profile.probe import probe_links
        facts["links"] = probe_links(args.nvme_dir, quick=not args.full, refresh=args.reprobe)
    if args.remote:
        facts["remote"] = _remote_facts(args.remote)
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        _print_facts(facts)
    return 0 if "remote" not in facts or facts["remote"]["reachable"] else 1


def _remote_facts(url: str) -> dict[str, object]:
    """The remote store's server, memory cap and measured link (a 4 MiB value written, read and deleted)."""
    from tierkv.tiers.remote import RemoteStore
    store = RemoteStore(url, "probe", retry_s=0)
    logging.getLogger("tierkv.tiers.remote").disabled = True     # the error is the report here
    try:
        link = store.probe()
        facts: dict[str, object] = {"url": store.name, "reachable": link is not None,
                                    "error": store.stats.last_error}
        if link is not None:
            facts |= {"rtt_s": link.rtt_s, "read_bytes_per_s": link.bytes_per_s, **store.info()}
        return facts
    finally:
        store.close()


def add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="what this machine offers: CUDA, GDS, pinned memory, NVMe backends")
    p.add_argument("--nvme-dir", type=path_arg, help="directory to probe for the NVMe tier")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--probe", action="store_true",
                   help="measure memcpy, device-link and disk (--nvme-dir) GB/s and latency; cached")
    p.add_argument("--reprobe", action="store_true", help="like --probe, measuring again instead of the cache")
    p.add_argument("--full", action="store_true", help="with --probe: a longer, steadier measurement")
    p.add_argument("--remote", metavar="URL", type=_remote_url,
                   help="a Redis/Valkey server (redis://host:6379): its version, memory cap, round trip and read "
                        "throughput; exits 1 when it cannot be reached")
    p.set_defaults(func=cmd_info)


def _remote_url(text: str) -> str:
    from tierkv.tiers.remote import check_url
    try:
        return check_url(text)
    except ConfigError as bad:
        raise argparse.ArgumentTypeError(str(bad).removeprefix(f"--remote {text!r}: ")) from None
