"""One mode's machinery in a session: the tier manager (its own store, one per block layout), the
engine, and how it makes, reports and empties states.

    dense    blocks of block_tokens tokens, content addressed     store  <nvme_dir>/kv-L...
    sparse   pages, plus an index per stored prefix               store  <nvme_dir>/sparse-P...
                                                                  shelf  <nvme_dir>/sparse-indexes
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tierkv.device import has_cuda
from tierkv.events import EventRecorder
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine
from tierkv.model.loading import LoadedModel
from tierkv.model.settings import SessionConfig
from tierkv.model.sparse_engine import SparseEngine
from tierkv.profile.access import AccessRecorder
from tierkv.session.prefill import shelf_of, sparse_state
from tierkv.session.state import DenseState, KVState, Progress, Seed, SparseState
from tierkv.sparse.store import Shelf


@dataclass(slots=True)
class Backend:
    mode: str
    config: SessionConfig
    loaded: LoadedModel
    layout: BlockLayout
    manager: BlockingTierManager
    engine: Engine | SparseEngine
    shelf: Shelf | None = None
    access: AccessRecorder | None = None
    eos: set[int] = field(default_factory=set)

    @property
    def events(self) -> EventRecorder:
        return self.manager.events

    def empty(self, prompt_tokens: int) -> KVState:
        """A state of no tokens, for a prompt of ``prompt_tokens`` (sparse settings resolve by it)."""
        if self.mode == "dense":
            return DenseState(self.engine)
        seq = self.engine.new_sequence(prompt_tokens)
        seq.detach()
        return SparseState(self.engine, seq, [])

    def state_of(self, ids: Sequence[int], progress: Progress | None = None,
                 seed: Seed | None = None) -> tuple[KVState, int]:
        """The state covering ``ids``, found stored where it can be, and the tokens found (or, in sparse
        mode, taken from ``seed``: a dense state's KV of its first tokens)."""
        if self.mode == "dense":
            state = DenseState(self.engine)
            try:
                state.absorb(list(ids), progress)
            except BaseException:        # what it sealed is let go of (a held block would stay for good)
                state.release()
                raise
            return state, state.reused
        settings = self.config.engine
        opened = sparse_state(self.engine, list(ids), self.shelf, reuse=settings.reuse,
                              checkpoint_every=settings.checkpoint_every, progress=progress, seed=seed)
        opened.state.seq.document_tokens = len(ids)
        return opened.state, opened.reused

    def report(self, state: KVState) -> dict[str, object]:
        """What the sparse step did for ``state`` (empty in dense mode)."""
        if not isinstance(state, SparseState):
            return {}
        return sparse_report(self.engine, state.seq)

    def tier_report(self) -> dict[str, dict[str, object]]:
        return {name: {**stats, "backend": _backend_name(self.manager.tier(name))}
                for name, stats in self.manager.tier_stats().items()}

    def buffer_report(self) -> dict[str, object] | None:
        """Dense mode: the bytes the layers' K/V buffers may take, took at most and hold now."""
        budget = getattr(self.engine, "buffers", None)
        if self.mode != "dense" or budget is None:
            return None
        return {"budget_bytes": budget.limit, "peak_bytes": budget.peak, "final_bytes": budget.used,
                "device": str(self.loaded.model.device)}

    def remote_report(self) -> dict[str, object] | None:
        """The remote store's counts (blocks read, written, skipped, damaged) and its link; None without one."""
        remote = self.manager.remote
        if remote is None:
            return None
        link = remote.measured_link()
        return {"url": remote.name, **remote.stats.as_dict(),
                "link": None if link is None else {"rtt_s": link.rtt_s, "bytes_per_s": link.bytes_per_s}}

    def pinned_blocks(self) -> int:
        """Blocks pinned or reserved in any tier now (0 once nothing reads or moves)."""
        return self.manager.busy_blocks()

    def held_blocks(self) -> int:
        """Blocks some state holds (documents and conversations the session keeps)."""
        return self.manager.held_blocks()

    def close(self) -> None:
        """Flush, then close the tiers, also where the flush fails (a full disk): nothing is left joined."""
        try:
            self.manager.flush()
        finally:
            self.manager.close()


def open_backend(mode: str, config: SessionConfig, loaded: LoadedModel, *, record_access: bool = False) -> Backend:
    spec = loaded.spec
    if mode == "dense":
        layout = config.engine.dense_engine().layout(spec)
    else:
        layout = SparseEngine.page_layout(loaded, config.sparse)
    manager = BlockingTierManager.from_config(config.tiers.tier_config(layout.block_bytes, layout.name),
                                              namespace=layout.name, recorder=EventRecorder())
    try:
        engine = Engine(loaded, manager, config.engine.dense_engine()) if mode == "dense" else \
            SparseEngine(loaded, manager, config.sparse, chunk_tokens=config.engine.chunk_tokens)
    except BaseException:
        manager.close()
        raise
    access = None
    if record_access:
        read_tier = "gpu" if has_cuda() else None
        access = AccessRecorder(read_tier=read_tier, info={"model": loaded.model_id, "engine": mode}
                                ).attach(manager.manager)
    shelf = shelf_of(engine, config.tiers.nvme_dir) if mode == "sparse" else None
    return Backend(mode, config, loaded, layout, manager, engine, shelf, access, eos_ids(loaded))


def eos_ids(loaded: LoadedModel) -> set[int]:
    configured = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    from_tokenizer = getattr(loaded.tokenizer, "eos_token_id", None)
    return {i for i in [from_tokenizer, *ids] if i is not None}


def sparse_report(engine: SparseEngine, seq) -> dict[str, object]:
    c, stats = seq.config, seq.stats
    return {
        "budget_tokens": c.budget_tokens(seq.length(0)), "allocation": c.allocation, "attend": c.attend,
        "layer_tokens": [int(seq.chosen[layer].shape[-1]) * c.chunk_tokens for layer in sorted(seq.chosen)],
        "rank": engine.rank, "selector": c.selector,
        "prefetch": c.prefetch, "overlap": c.overlap, "positions": c.positions, "chunk_tokens": c.chunk_tokens,
        "page_tokens": c.page_tokens, "page_bytes": engine.layout.block_bytes,
        "page_dtype": c.page_dtype or str(engine.layout.dtype).removeprefix("torch."),
        "landmark_dtype": "int8" if c.int8_landmarks else str(engine.layout.dtype).removeprefix("torch."),
        "dense_prefill_tokens": c.dense_prefill_tokens,
        "approximate_prefill": seq.document_tokens > c.dense_prefill_tokens,
        "pages_read": stats.pages, "reuse_rate": stats.reused / stats.pages if stats.pages else 0.0,
        "tokens_per_layer_step": stats.tokens / stats.steps if stats.steps else 0.0,
        "key_energy_kept": min(layer.basis.energy_kept for layer in seq.layers),
        "index_bytes": seq.memory_bytes(),
        "resumed_prefill_tokens": seq.resumed_tokens, "prefill_s_all_runs": round(seq.prefill_s, 1),
        "repairs": [asdict(r) for r in seq.origin.repairs] if seq.origin is not None else [],
    }


def _backend_name(tier) -> str:
    if hasattr(tier, "backend"):
        return tier.backend
    if tier.name == "gpu":
        return "cuda" if tier.device.type == "cuda" else "host memory (no CUDA)"
    return "pinned host memory" if has_cuda() else "host memory"
