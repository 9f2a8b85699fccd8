"""A model prepared for one policy: weights placed in the tiers, KV managers sized, a runner ready.

``BatchEngine.generate(prompts)`` runs one block of sequences (at most ``policy.block_size``
prompts) greedily through the zig-zag schedule and returns each prompt's new tokens::

    prompts --> GPU batches of gpu_batch_size rows (left-padded) --> runner over plan(...)
            --> tokens per prompt, cut after the first end-of-sequence token

Budgets follow the policy: the weights' cpu/disk shares go to a tier manager of their own
(cpu tier + NVMe store, 1 MiB blocks), the KV of a block to another (gpu, cpu and NVMe tiers
sized from ``policy.kv`` and the longest sequence the engine was built for). Both NVMe stores
live in a private directory under ``nvme_dir`` that ``close`` removes. ``close(restore=True)``
gives the model its weights back so it can be used on its own again.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.config import TierConfig
from tierkv.device import compute_device
from tierkv.errors import ConfigError
from tierkv.manager import BlockingTierManager, TierManager
from tierkv.manager.build import build_tiers
from tierkv.model.arch import decoder_layers
from tierkv.model.loading import LoadedModel
from tierkv.schedule.compute import GpuBatch
from tierkv.schedule.cost import COMPRESSED
from tierkv.schedule.home import HomePolicy
from tierkv.layout import BlockLayout
from tierkv.schedule.kvstore import BlockKV
from tierkv.schedule.policy import Policy
from tierkv.schedule.runner import Runner, Trace
from tierkv.schedule.weights import WeightStore, storage_dtype, stored_nbytes, tensor_homes

WEIGHT_BLOCK = 1024 * 1024
BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The longest sequences the engine is sized for."""

    max_prompt_tokens: int
    max_new_tokens: int
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "block_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")

    @property
    def blocks_per_cell(self) -> int:
        return math.ceil((self.max_prompt_tokens + self.max_new_tokens) / self.block_tokens)


class BatchEngine:
    def __init__(self, loaded: LoadedModel, policy: Policy, limits: EngineLimits, *,
                 nvme_dir: Path | None = None, trace: Trace | None = None) -> None:
        if policy.act.gpu < 1.0:
            raise ConfigError(f"policy act={policy.act.to_dict()}: the runner keeps activations on the "
                              "compute device; allowed: act gpu=1")
        needs_disk = policy.weights.disk > 0 or policy.kv.disk > 0
        if needs_disk and nvme_dir is None:
            raise ConfigError(f"policy puts weights or KV on disk ({policy.describe()}); give --nvme-dir")
        self.loaded, self.policy, self.limits = loaded, policy, limits
        spec = loaded.spec
        self.spec = spec
        self.scratch = Path(tempfile.mkdtemp(prefix="tierkv-batch-", dir=_existing(nvme_dir))) if needs_disk else None
        self._managers: list[BlockingTierManager] = []
        self.kv_layout = BlockLayout.batch_kv(spec.num_kv_heads, spec.head_dim, spec.dtype, limits.block_tokens,
                                              policy.gpu_batch_size, codec=COMPRESSED if policy.compress_kv else None)
        try:
            layers = decoder_layers(loaded.model)
            self.weight_homes: set = set()
            self.weights = WeightStore(layers, policy.weights, self._weight_manager(layers), self.weight_homes,
                                       WEIGHT_BLOCK, compute_device(), storage_dtype(policy.weight_dtype))
            self.kv_homes: set = set()
            self.kv_manager = self._kv_manager()
            self.runner = Runner(loaded.model, self.weights, overlap=policy.overlap, group=spec.group, trace=trace)
        except BaseException:
            self._close_managers()
            raise
        self.last_kv: BlockKV | None = None

    # -- managers --------------------------------------------------------------
    def _weight_manager(self, layers) -> BlockingTierManager | None:
        w = self.policy.weights
        if w.gpu >= 1.0:
            return None
        homes = tensor_homes(layers[0], w)
        params, store = dict(layers[0].named_parameters()), storage_dtype(self.policy.weight_dtype)
        per_tier = {t: sum(stored_nbytes(params[n], store) for n, h in homes.items() if h == t) for t in ("cpu", "disk")}
        if not per_tier["cpu"] and not per_tier["disk"]:
            return None
        blocks = {t: math.ceil(b / WEIGHT_BLOCK) for t, b in per_tier.items()}
        cpu = (blocks["cpu"] * len(layers) + 2 * blocks["disk"] + 1) * WEIGHT_BLOCK
        disk = blocks["disk"] * len(layers) * WEIGHT_BLOCK
        return self._manager(WEIGHT_BLOCK, 0, cpu, disk, "weights", self.weight_homes)

    def _kv_manager(self) -> BlockingTierManager:
        bb, cells = self.kv_layout.block_bytes, self.spec.num_layers * self.policy.num_gpu_batches
        gpu, cpu, disk = self.policy.kv.split(self.limits.blocks_per_cell)
        staging = 2 * disk + 1 if disk else 0
        return self._manager(bb, gpu * cells * bb, (cpu * cells + staging) * bb, disk * cells * bb, "kv",
                             self.kv_homes)

    def _manager(self, block: int, gpu: int, cpu: int, disk: int, name: str, homes: set) -> BlockingTierManager:
        nvme = None if not disk else self.scratch / name
        config = TierConfig(block_bytes=block, gpu=gpu, cpu=cpu, nvme_dir=nvme,
                            nvme_budget=max(disk, block) if nvme else 64 * 1024**3)
        tiers = build_tiers(config, namespace=f"batch-{name}")
        manager = BlockingTierManager(TierManager(tiers, policies={t.name: HomePolicy(homes) for t in tiers}))
        self._managers.append(manager)
        return manager

    # -- generating ------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                 eos_ids: Sequence[int] = (), ignore_eos: bool = False) -> list[list[int]]:
        """Greedy new tokens of each prompt (one block: at most ``policy.block_size`` prompts)."""
        limit = self.limits.max_new_tokens if max_new_tokens is None else max_new_tokens
        self._check(prompts, limit)
        pad_id = eos_ids[0] if eos_ids else 0
        bs = self.policy.gpu_batch_size
        batches = [GpuBatch.from_prompts([list(p) for p in prompts[i:i + bs]], pad_id)
                   for i in range(0, len(prompts), bs)]
        kv = BlockKV(self.kv_manager, self.kv_layout, self.spec.num_layers, [b.rows for b in batches],
                     self.policy.kv, self.limits.blocks_per_cell, self.kv_homes)
        eos = set(eos_ids)

        def finished() -> bool:
            return not ignore_eos and all(any(t in eos for t in row) for b in batches for row in b.tokens)
        try:
            self.runner.run(batches, kv, limit, stop=finished)
        finally:
            kv.close()
            self.last_kv = kv
        return [_cut(row, eos, ignore_eos) for b in batches for row in b.tokens]

    def _check(self, prompts: Sequence[Sequence[int]], limit: int) -> None:
        if not prompts or len(prompts) > self.policy.block_size:
            raise ConfigError(f"{len(prompts)} prompts: a block holds 1 to {self.policy.block_size}")
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ConfigError("a prompt is empty")
        if longest > self.limits.max_prompt_tokens or limit > self.limits.max_new_tokens:
            raise ConfigError(f"prompt of {longest} tokens + {limit} new: the engine is sized for "
                              f"{self.limits.max_prompt_tokens} + {self.limits.max_new_tokens}")

    # -- lifecycle -------------------------------------------------------------
    def close(self, *, restore: bool = False) -> None:
        try:
            self.runner.close()
            self.weights.close(restore=restore)
        finally:
            self._close_managers()

    def _close_managers(self) -> None:
        for manager in self._managers:
            manager.close()
        self._managers.clear()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cut(row: list[int], eos: set[int], ignore_eos: bool) -> list[int]:
    if ignore_eos:
        return list(row)
    for i, token in enumerate(row):
        if token in eos:
            return row[:i + 1]
    return list(row)


def _existing(path: Path | None) -> str | None:
    if path is None:
        return None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return os.fspath(path)
