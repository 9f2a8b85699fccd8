"""Settings of sparse attention: budget, rank, chunking, what stays exact, positions.

One frozen ``SparseConfig`` per run; every field is validated on creation,
and an error names the field, the value and what is allowed. Fields left
``None`` are resolved against the model and the prompt by ``resolve``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from tierkv.codec import SCALES, KVCodec
from tierkv.errors import ConfigError
from tierkv.flags import setting

POSITIONS = ("auto", "original", "remap")
# The fields that shape a stored index (tierkv.sparse.store): what is kept in memory and in the
# pages, and how a sparse prefill computed it. The rest only steer decode and may differ between
# the run that stored an index and the runs that read it.
INDEX_FIELDS = ("prefill_budget", "rank", "chunk_tokens", "page_tokens", "page_dtype", "sink_tokens",
                "window_tokens", "outlier_fraction", "max_outlier_tokens", "selector", "positions",
                "dense_prefill_tokens", "landmark_dtype")
LATER_FIELDS = {"landmark_dtype"}       # named in an identity only when set: earlier stores keep theirs
ALLOCATIONS = ("uniform", "adaptive")   # tierkv.sparse.allocation
ATTENDS = ("pages", "chunks")           # what a decode step attends of what it read


def _page_spellings(page_dtype: str | None, codec: KVCodec | None, head_dim: int, model_dtype: str) -> list:
    """Every ``page_dtype`` that stores pages as ``page_dtype`` does (see ``SparseConfig.spellings``)."""
    if codec is None:
        return [None, model_dtype] if page_dtype in (None, model_dtype) else [page_dtype]
    head = page_dtype.split("-")[0]
    groups = ["", f"g{head_dim}"] if codec.value_group in (None, head_dim) else [f"g{codec.value_group}"]
    scale = next(name for name, dtype in SCALES.items() if dtype == codec.scale_dtype)
    scales = ["", "sf16"] if scale == "f16" else [f"s{scale}"]
    options = [[o for o in pair if o] for g in groups for s in scales for pair in ((g, s), (s, g))]
    return list(dict.fromkeys("-".join([head, *parts]) for parts in options))


def parse_budget(value: str | int | float, field: str = "sparse_budget") -> int | float:
    """``2048`` -> 2048 tokens per KV head; ``"2%"`` / ``0.02`` -> that share of the context."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r}: expected tokens (2048) or a share of the context (2%)")
    if isinstance(value, (int, float)) and not isinstance(value, str):
        number: int | float = value
    else:
        text = str(value).strip()
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
        if match:
            number = float(match.group(1)) / 100
        elif text.isdigit():
            number = int(text)
        else:
            raise ConfigError(f"{field}={value!r}: expected tokens (2048) or a share of the context (2%)")
    if isinstance(number, float) and not 0 < number <= 1:
        raise ConfigError(f"{field}={value!r}: a share must be more than 0% and at most 100%")
    if isinstance(number, int) and number < 0:
        raise ConfigError(f"{field}={value!r}: tokens must be >= 0 (0: the sinks and the window only)")
    return number


def parse_layer_budgets(value: str | Mapping[int, int | float] | tuple = ()) -> tuple[tuple[int, int | float], ...]:
    """``"0:8192;1:4096"`` (or {0: 8192, 1: 4096}) -> ((0, 8192), (1, 4096)): decode budgets of
    single layers, tokens or a share as for ``budget``."""
    if isinstance(value, str):
        pairs = []
        for part in filter(None, (p.strip() for p in value.split(";"))):
            layer, sep, budget = part.partition(":")
            if not sep or not layer.strip().isdigit():
                raise ConfigError(f"layer_budgets={value!r}: expected LAYER:BUDGET pairs split by ';', "
                                  "like 0:8192 or 0:8192;1:5%")
            pairs.append((int(layer), budget))
    else:
        pairs = list(value.items() if isinstance(value, Mapping) else value)
    layers = [layer for layer, _ in pairs]
    if len(set(layers)) != len(layers) or any(not isinstance(x, int) or x < 0 for x in layers):
        raise ConfigError(f"layer_budgets={value!r}: each layer (an index >= 0) at most once")
    return tuple(sorted((layer, parse_budget(b, f"layer_budgets[{layer}]")) for layer, b in pairs))


@dataclass(frozen=True, slots=True)
class SparseConfig:
    """Settings of sparse mode; the fields with help are ``tierkv run`` flags (see ``tierkv.flags``)."""

    budget: int | float = setting(2048, "selected tokens per KV head and step: a count or a share like 2% (0: only "
                                        "the first and the newest tokens, which every step attends)",
                                  flag="--sparse-budget", metavar="N|P%")
    prefill_budget: int | float = setting(1024, "the same for each chunk of a sparse prefill", metavar="N|P%")
    rank: int | None = setting(None, "rank of the low-rank keys (default: full up to 256 key dimensions, else "
                                     "160 per 1024, at least 128)", metavar="R")
    chunk_tokens: int = 8           # tokens summarised by one landmark
    page_tokens: int | None = setting(
        None, "tokens per stored page, a multiple of 8 (default: 16; a quantized page the fewest that pack into "
              "4 KiB blocks with little padding, SmolLM2: int8 80, int4 56, int2 104; 32 past ~500K tokens halves "
              "the pages, and the ~100 bytes of bookkeeping the tier manager and the store keep per page)", metavar="N")
    page_dtype: str | None = setting(
        None, "how stored values and key factors are kept: float32, bfloat16, float16 (default: the model's "
              "--dtype), or quantized int8, int4, int2 (values per token, key factors per channel; options "
              "-g<N> channels per value scale, -s<f16|bf16|f32> scale dtype, like int4-g32)", metavar="DTYPE")
    landmark_dtype: str | None = setting(
        None, "how chunk landmarks are kept: int8 (a scale per chunk and head) or the pages' float dtype "
              "(default: int8 when pages are quantized, else the pages' dtype)", choices=("int8", "float"))
    sink_tokens: int = 16           # first tokens, always attended, kept exact
    window_tokens: int = 512        # newest tokens, always attended, kept exact
    outlier_fraction: float = 0.01  # chunks kept exact because their landmark describes them worst
    max_outlier_tokens: int = 512   # cap, so remapped positions stay inside the trained window
    # decode budgets of single layers ("0:6144")
    layer_budgets: tuple[tuple[int, int | float], ...] = setting(
        (), "decode budgets of single layers, like 0:6144 (layer 0 attends broadly: at 16K its best 2048 tokens "
            "hold 60% of its attention)", aliases=("--layer-budget",), metavar="L:N[;L:N]", kind=str)
    # decode budgets the same in every layer, or moved between layers at an unchanged total as
    # estimated from the landmarks (tierkv.sparse.allocation)
    allocation: str = setting("uniform", "uniform: every layer the same budget; adaptive: move it between layers "
                                         "at the same total, by coverage estimated from the landmarks (it raised "
                                         "coverage but lowered agreement with dense on SmolLM2 at 8K)",
                              flag="--layer-allocation", choices=ALLOCATIONS)
    # a decode step reads whole pages (all KV heads, page_tokens tokens) for the chunks each head
    # selected; "pages": each head attends more of those pages, up to twice its own selection (more
    # of the dense mass at no extra read; tierkv.sparse.plan.WholePages), "chunks": each head only its
    # own chunks
    attend: str = setting("pages", "pages: each KV head also attends other chunks of the pages its step read, up "
                                   "to twice its own selection (no extra read, more of the attention covered); "
                                   "chunks: each head only the chunks it selected",
                          flag="--sparse-attend", choices=ATTENDS)
    # decode: attend to the pages in place while the rest load, then to those (merged exactly); with
    # the loads off the worker threads (native AIO) it hides them at no cost in tokens/s, so it is on
    overlap: bool = setting(True, "decode: wait for all of a layer's pages before attending to any (by default "
                                  "a layer attends to the pages in memory while the rest load from NVMe, then to "
                                  "those: an exact merge that hides the loads)", flag="--no-sparse-overlap")
    selector: str = setting("shadowkv", "chunk selector: shadowkv (landmarks), quest (page bounds), near-memory "
                                        "(scored in a simulated CXL pool), or module:Class", metavar="NAME")
    prefetch: str = setting("none", "what to load for layer l+1 during layer l: none (on a CPU a guess costs "
                                    "more than it hides), speculative, previous-step", flag="--sparse-prefetch",
                            metavar="NAME")
    positions: str = setting("auto", "RoPE positions of attended keys: remap = compact positions inside the "
                                     "trained window (auto: past it), original = real positions", choices=POSITIONS)
    dense_prefill_tokens: int | None = setting(
        None, "prefill exactly up to N tokens, sparsely after (default: the whole prompt within the trained "
              "window, half the window past it)", metavar="N")

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_budget(self.budget))
        object.__setattr__(self, "prefill_budget", parse_budget(self.prefill_budget, "prefill_budget"))
        object.__setattr__(self, "layer_budgets", parse_layer_budgets(self.layer_budgets))
        if self.chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens={self.chunk_tokens}: must be > 0")
        budgets = [("sparse_budget", self.budget), ("prefill_budget", self.prefill_budget),
                   *((f"layer_budgets[{layer}]", budget) for layer, budget in self.layer_budgets)]
        for name, budget in budgets:      # (selections are whole chunks: a smaller count would select none)
            if isinstance(budget, int) and 0 < budget < self.chunk_tokens:
                raise ConfigError(f"{name}={budget}: less than one chunk of {self.chunk_tokens} tokens, so it would "
                                  f"select nothing; use at least {self.chunk_tokens}, or 0 for the first and the "
                                  "newest tokens only")
        if self.page_tokens is not None and self.page_tokens <= 0:
            raise ConfigError(f"page_tokens={self.page_tokens}: must be > 0")
        if self.page_tokens is not None and self.page_tokens % self.chunk_tokens:
            raise ConfigError(f"page_tokens={self.page_tokens}: must be a multiple of the tokens one landmark "
                              f"summarises (the sparse chunk_tokens, {self.chunk_tokens}; not --chunk-tokens, the "
                              "prefill's chunk)")
        for name in ("sink_tokens", "window_tokens", "max_outlier_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.sink_tokens % self.chunk_tokens:
            raise ConfigError(f"sink_tokens={self.sink_tokens}: must be a multiple of the sparse "
                              f"chunk_tokens, {self.chunk_tokens}")
        if not 0 <= self.outlier_fraction < 1:
            raise ConfigError(f"outlier_fraction={self.outlier_fraction}: must be in [0, 1)")
        if self.rank is not None and self.rank <= 0:
            raise ConfigError(f"rank={self.rank}: must be > 0 (unset: the default)")
        if self.allocation not in ALLOCATIONS:
            raise ConfigError(f"allocation={self.allocation!r}: allowed: {', '.join(ALLOCATIONS)}")
        if self.attend not in ATTENDS:
            raise ConfigError(f"attend={self.attend!r}: allowed: {', '.join(ATTENDS)}")
        if self.positions not in POSITIONS:
            raise ConfigError(f"positions={self.positions!r}: allowed: {', '.join(POSITIONS)}")
        if self.landmark_dtype not in (None, "int8", "float"):
            raise ConfigError(f"landmark_dtype={self.landmark_dtype!r}: allowed: int8, float")
        try:
            KVCodec.parse(self.page_dtype)
        except ConfigError as bad:
            raise ConfigError(f"page_dtype={bad}") from None
        if self.dense_prefill_tokens is not None and self.dense_prefill_tokens < 0:
            raise ConfigError(f"dense_prefill_tokens={self.dense_prefill_tokens}: must be >= 0")
        from policies.selectors import make_selector, make_sparse_prefetch
        make_selector(self.selector)          # unknown names list the valid ones
        make_sparse_prefetch(self.prefetch)

    @property
    def codec(self) -> KVCodec | None:
        """How pages are quantized (None: stored in a float dtype)."""
        return KVCodec.parse(self.page_dtype)

    @property
    def int8_landmarks(self) -> bool:
        return self.landmark_dtype == "int8" or (self.landmark_dtype is None and self.codec is not None)

    def spellings(self, head_dim: int, model_dtype: str) -> list[SparseConfig]:
        """This configuration under the other spellings of its page and landmark formats: ``int4``,
        ``int4-g64`` and ``int4-sf16-g64`` for heads of 64 dims; no page dtype and the model's own; no
        landmark dtype and its default. Each names a stored index of its own (``identity``)."""
        landmark = "int8" if self.codec is not None else "float"
        landmarks = [None, landmark] if self.landmark_dtype in (None, landmark) else [self.landmark_dtype]
        found = [replace(self, page_dtype=page, landmark_dtype=mark)
                 for page in _page_spellings(self.page_dtype, self.codec, head_dim, model_dtype) for mark in landmarks]
        return [config for config in found if config.identity() != self.identity()]

    def identity(self) -> tuple:
        """The settings that shape a stored index, as (name, value) pairs (``INDEX_FIELDS``)."""
        return tuple((name, getattr(self, name)) for name in INDEX_FIELDS
                     if name not in LATER_FIELDS or getattr(self, name) is not None)

    def budget_tokens(self, context: int, *, prefill: bool = False, layer: int | None = None) -> int:
        """Selected tokens per KV head for a context of ``context`` tokens (whole chunks); a decode
        step of ``layer`` takes that layer's own budget when ``layer_budgets`` names it."""
        budget = self.prefill_budget if prefill else dict(self.layer_budgets).get(layer, self.budget)
        tokens = budget if isinstance(budget, int) else int(budget * context)
        return tokens // self.chunk_tokens * self.chunk_tokens

    def key_rank(self, key_dims: int) -> int:
        """The rank of the low-rank keys for ``key_dims`` = Hkv * D.

        ShadowKV's 160 for Llama-3-8B's 1024 key dims, scaled. Narrow keys are kept at full rank:
        there the factors would save at most a third of a page while costing accuracy (SmolLM2,
        192 dims, 16K document: rank 96 agrees with dense on 72 % of the steps, full rank 89 %).
        """
        if self.rank is not None:
            if self.rank > key_dims:
                raise ConfigError(f"rank={self.rank}: at most the key dimensions Hkv*D={key_dims}")
            return self.rank
        return key_dims if key_dims <= 256 else max(key_dims * 160 // 1024, 128)

    def resolve(self, *, prompt_tokens: int, trained_tokens: int) -> SparseConfig:
        """Fill ``positions`` and ``dense_prefill_tokens`` for one prompt.

        Within the trained window the prompt is prefilled exactly and RoPE keeps the real positions
        (the index is built at the end, as ShadowKV does). Past it, dense attention leaves the
        positions the model knows: the first tokens (up to half the window) are prefilled exactly,
        the rest attend sparsely, and every attention uses compact (remapped) positions.
        """
        beyond = prompt_tokens > trained_tokens
        positions = self.positions if self.positions != "auto" else ("remap" if beyond else "original")
        dense = self.dense_prefill_tokens
        if dense is None:
            dense = min(prompt_tokens, trained_tokens // 2) if beyond else prompt_tokens
        return replace(self, positions=positions, dense_prefill_tokens=dense)
