"""The cost model: a policy's time per block and memory per tier, linear in its placement fractions.

For a fixed batch shape (gpu batch size, number of GPU batches, compression, overlap) every time
and memory term is ``const + sum(coef[f] * f)`` over the six fractions ``f`` in
``wg wc wd cg cc cd`` (weights and KV on gpu / cpu / disk). `predict` evaluates the terms at a
policy; `tierkv.schedule.search` hands the same terms to a linear program, so the LP's optimum
is exactly what `predict` says of the policy it returns.

Per layer and token step (prefill: ``T = P`` tokens per row, decode: one, at context ``c``)::

    compute    prefill: nb * sum over groups of rows of one length (layer(rows * len)
                        + attention(rows, len, len))    unpadded, causal; rows under 64 tokens
                        form one group, padded to its longest (compute.prefill_groups)
               decode:  nb * (layer(bs) + attention(bs, 1, c))   [+ dequantize the KV read]
    copies     S_l * (wc + wd) / memcpy                  staging a layer's streamed weights
               [S_l * (wc + wd) / convert]                and converting them to the compute dtype
               nb * kv(c) / memcpy                        gathering each cell's KV (decode)
               nb * kv_new(T) / memcpy                    packing new KV into blocks
    disk read  S_l * wd / read  +  nb * kv(c) * cd / read
    disk write nb * kv_new(T) * cd / write

    overlap:   layer time >= every one of: compute + copies (on a CPU-only machine the copies run
               on the cores that compute; on CUDA they run on copy engines: a term of their own),
               disk read, disk write
    serial:    layer time  = the sum

    block time = L * (t_prefill + (n - 1) * t_decode) + n * nb * head(bs)
    throughput = bs * nb * n / block time                 (n = new tokens, prefill included)

``W_l`` is a layer's weight bytes in the compute dtype, ``S_l`` as the tiers keep them: in
``policy.weight_dtype`` when it is set (half of W_l for bf16 under fp32), W_l otherwise; the
conversion term is there only when the two dtypes differ.

Memory per tier (bytes) for the policy, with the KV of the longest sequence ``P + n``::

    gpu   other weights + wg*W + (1-wg)*(2*W_l [+ S_l]) (staging slots [+ raw buffer]) + cg*KV
          + working KV + activations
    cpu   wc*S + wd*2*S_l (disk staging) + cc*KV + cd*2*kv_cell
    disk  wd*S + cd*KV                                    (S = L * S_l)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from tierkv.codec import KVCodec
from tierkv.errors import ConfigError
from tierkv.model.arch import decoder_layers, model_spec, weight_bytes
from tierkv.schedule.compute import prefill_groups
from tierkv.schedule.policy import WEIGHT_DTYPES, Placement, Policy

FRACTIONS = ("wg", "wc", "wd", "cg", "cc", "cd")
COMPRESSED = KVCodec(4)      # how a policy with compress_kv stores KV (int4, tierkv.codec)


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    layer_weight_bytes: int
    other_weight_bytes: int        # embeddings, final norm, lm_head: always resident
    intermediate: int
    dtype: str | None = None       # the compute's (torch name); None: unknown, a storage dtype converts

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        spec = model_spec(model)
        layers = decoder_layers(model)
        layer_bytes, total = weight_bytes(layers[0]), weight_bytes(model)
        first = next(model.parameters())
        return cls(spec.num_layers, spec.hidden, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                   first.element_size(), layer_bytes, total - layer_bytes * spec.num_layers,
                   getattr(model.config, "intermediate_size", 4 * spec.hidden), str(first.dtype).removeprefix("torch."))

    @property
    def weight_bytes(self) -> int:
        return self.layer_weight_bytes * self.num_layers

    def stored_layer_bytes(self, weight_dtype: str | None) -> float:
        """One layer's weights as the tiers keep them: in ``weight_dtype``, or the compute's (None)."""
        if weight_dtype is None:
            return self.layer_weight_bytes
        return self.layer_weight_bytes * getattr(torch, weight_dtype).itemsize / self.itemsize

    def converts(self, weight_dtype: str | None) -> bool:
        return weight_dtype is not None and weight_dtype != self.dtype

    def kv_bytes(self, rows: int, tokens: int, compress: bool) -> float:
        """K and V of ``rows`` x ``tokens`` in one layer, as stored."""
        numel = rows * tokens * self.num_kv_heads * self.head_dim
        return 2 * (COMPRESSED.approx_bytes(numel, self.head_dim) if compress else numel * self.itemsize)


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_len: int       # padded prompt length of a block (time)
    gen_len: int          # new tokens per sequence
    num_sequences: int = 1 << 30
    max_prompt_len: int = 0   # the longest prompt (memory); 0: prompt_len
    lengths: tuple[int, ...] = ()   # every prompt's length, when they differ (padding is priced)

    def __post_init__(self) -> None:
        for name in ("prompt_len", "gen_len", "num_sequences"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"workload {name}={getattr(self, name)}: must be > 0")
        object.__setattr__(self, "lengths", tuple(sorted(self.lengths, reverse=True)))
        longest = self.lengths[0] if self.lengths else 0
        object.__setattr__(self, "max_prompt_len", max(self.max_prompt_len, self.prompt_len, longest))

    def batches(self, bs: int) -> list[tuple[int, ...]]:
        """The prompt lengths of each GPU batch of ``bs`` prompts cut from the longest down (the job sorts)."""
        return [self.lengths[i:i + bs] for i in range(0, len(self.lengths), bs)]

    def padded_len(self, bs: int) -> float:
        """Mean padded prompt of GPU batches of ``bs`` prompts cut from the longest down (the job sorts)."""
        if not self.lengths:
            return self.prompt_len
        maxima = [self.lengths[i] for i in range(0, len(self.lengths), bs)]
        sizes = [min(bs, len(self.lengths) - i) for i in range(0, len(self.lengths), bs)]
        return sum(m * n for m, n in zip(maxima, sizes)) / len(self.lengths)


@dataclass(frozen=True, slots=True)
class Budgets:
    gpu: int
    cpu: int
    disk: int = 0

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "disk"):
            if getattr(self, name) < 0:
                raise ConfigError(f"budget {name}={getattr(self, name)}: must be >= 0")


@dataclass(frozen=True, slots=True)
class Machine:
    """Measured rates (see tierkv.schedule.calibrate). Times in seconds, rates in bytes/s."""

    memcpy: float
    disk_read: float
    disk_write: float
    layer_s: Callable[[int], float]          # dense part of one layer for M tokens (matmuls, norms, overhead)
    attention_s: Callable[[int, int, int], float]   # (rows, query tokens, keys) -> seconds, one layer
    head_s: Callable[[int], float]           # embedding + final norm + lm_head for M rows
    dequant: float = 2e9                      # bytes/s of int4 KV decoded
    convert: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WEIGHT_DTYPES, 4e9))
    # ^ bytes/s of stored weights (by storage dtype) converted to the compute dtype
    copies_on_compute: bool = True           # CPU-only: copies share the cores with compute


@dataclass(slots=True)
class Linear:
    """``const + sum(coef[f] * f)`` over the six fractions."""

    const: float = 0.0
    coef: dict[str, float] = field(default_factory=dict)

    def __add__(self, other: Linear) -> Linear:
        coef = dict(self.coef)
        for name, value in other.coef.items():
            coef[name] = coef.get(name, 0.0) + value
        return Linear(self.const + other.const, coef)

    def scale(self, k: float) -> Linear:
        return Linear(self.const * k, {n: v * k for n, v in self.coef.items()})

    def at(self, x: dict[str, float]) -> float:
        return self.const + sum(v * x[n] for n, v in self.coef.items())


def fractions(policy: Policy) -> dict[str, float]:
    w, c = policy.weights, policy.kv
    return {"wg": w.gpu, "wc": w.cpu, "wd": w.disk, "cg": c.gpu, "cc": c.cpu, "cd": c.disk}


@dataclass(frozen=True, slots=True)
class Terms:
    """The linear terms of one batch shape: ``phases`` maps prefill/decode to its lower bounds."""

    phases: dict[str, list[Linear]]
    serial: dict[str, Linear]
    thread: dict[str, Linear]         # what the compute thread's time covers in one layer, per phase
    fixed_s: float                    # per block, outside the layers (head)
    memory: dict[str, Linear]         # gpu, cpu, disk
    layers: int
    gen_len: int
    sequences: int
    overlap: bool
    bs: int = 1
    nb: int = 1
    compress: bool = False
    weight_dtype: str | None = None


def terms(shape: ModelShape, work: Workload, m: Machine, bs: int, nb: int, *, compress: bool,
          overlap: bool, weight_dtype: str | None = None, rows: int | None = None) -> Terms:
    """``rows``: the sequences a block holds when fewer than ``bs * nb`` (a job of fewer documents). The
    engine then runs only the GPU batches they fill, and computes only their rows; its KV blocks and
    the memory it sets aside keep ``bs`` rows and ``nb`` batches."""
    memory = memory_terms(shape, work, bs, nb, compress, weight_dtype)
    rows = bs * nb if rows is None else min(rows, bs * nb)
    nb, cbs = -(-rows // bs), min(bs, rows)          # the batches that run, the rows one computes
    P, n, L = round(work.padded_len(bs)), work.gen_len, shape.num_layers
    S_l = shape.stored_layer_bytes(weight_dtype)
    stage = S_l / m.memcpy + (S_l / m.convert[weight_dtype] if shape.converts(weight_dtype) else 0.0)
    phases, serial, thread = {}, {}, {}
    for phase, T, ctx in (("prefill", P, 0), ("decode", 1, P + n // 2)):
        work_s = prefill_s(work, m, bs) if phase == "prefill" else m.layer_s(cbs) + m.attention_s(cbs, 1, ctx + 1)
        compute = Linear(nb * work_s)
        kv_read = shape.kv_bytes(bs, ctx, compress) * nb
        kv_new = shape.kv_bytes(bs, T, compress) * nb
        if compress:
            compute = compute + Linear(kv_read / m.dequant + kv_new / m.dequant)
        copies = Linear(0.0, {"wc": stage, "wd": stage}) + Linear(kv_read / m.memcpy) + Linear(kv_new / m.memcpy)
        disk_read = Linear(0.0, {"wd": S_l / m.disk_read, "cd": kv_read / m.disk_read})
        disk_write = Linear(0.0, {"cd": kv_new / m.disk_write})
        shared = overlap and m.copies_on_compute   # loader threads take the compute's cores meanwhile
        thread[phase] = compute + copies if shared else compute
        bounds = [compute + copies] if m.copies_on_compute else [compute, copies]
        phases[phase] = bounds + [disk_read, disk_write]
        serial[phase] = compute + copies + disk_read + disk_write
    return Terms(phases, serial, thread, n * nb * m.head_s(cbs), memory, L, n, rows, overlap, bs, nb, compress,
                 weight_dtype)


def prefill_s(work: Workload, m: Machine, bs: int) -> float:
    """One layer's prefill of a GPU batch (the mean over the job's), in the runner's groups
    (`tierkv.schedule.compute.prefill_groups`): unpadded and causal, short rows padded together."""
    def batch_s(lengths: tuple[int, ...]) -> float:
        total = 0.0
        for rows in prefill_groups(list(lengths)):
            T = max(lengths[r] for r in rows)
            total += m.layer_s(len(rows) * T) + m.attention_s(len(rows), T, T)
        return total
    batches = work.batches(bs) or [(work.prompt_len,) * bs]
    return sum(map(batch_s, batches)) / len(batches)


def largest_group(work: Workload, bs: int) -> int:
    """The most tokens (rows x length) one prefill group of a GPU batch computes at once."""
    batches = work.batches(bs) or [(work.max_prompt_len,) * bs]
    return max(len(rows) * max(b[r] for r in rows) for b in batches for rows in prefill_groups(list(b)))


def memory_terms(shape: ModelShape, work: Workload, bs: int, nb: int, compress: bool,
                 weight_dtype: str | None = None) -> dict[str, Linear]:
    P, n, L, W_l = work.max_prompt_len, work.gen_len, shape.num_layers, shape.layer_weight_bytes
    S_l = shape.stored_layer_bytes(weight_dtype)
    staging = 2 * W_l + (S_l if shape.converts(weight_dtype) else 0.0)
    kv_cell = shape.kv_bytes(bs, P + n, compress)
    kv_all = kv_cell * L * nb
    working = 3 * shape.kv_bytes(bs, P + n, False) + L * nb * shape.kv_bytes(bs, 16, False)
    group = largest_group(work, bs)      # tokens one prefill group computes at once
    act = shape.itemsize * (bs * P * nb * shape.hidden + group * (3 * shape.intermediate + 4 * shape.hidden))
    gpu = Linear(shape.other_weight_bytes + working + act + staging,
                 {"wg": shape.weight_bytes - staging, "cg": kv_all})
    cpu = Linear(0.0, {"wc": S_l * L, "wd": 2 * S_l, "cc": kv_all, "cd": 2 * kv_cell})
    disk = Linear(0.0, {"wd": S_l * L, "cd": kv_all})
    return {"gpu": gpu, "cpu": cpu, "disk": disk}


@dataclass(frozen=True, slots=True)
class Estimate:
    prefill_layer_s: float
    decode_layer_s: float
    block_s: float
    tokens_per_s: float
    memory: dict[str, float]

    def fits(self, budgets: Budgets) -> bool:
        return all(self.memory[t] <= getattr(budgets, t) + 1 for t in ("gpu", "cpu", "disk"))


def evaluate(t: Terms, x: dict[str, float]) -> Estimate:
    if t.overlap:
        pre, dec = (max(b.at(x) for b in t.phases[p]) for p in ("prefill", "decode"))
    else:
        pre, dec = (t.serial[p].at(x) for p in ("prefill", "decode"))
    block = t.layers * (pre + (t.gen_len - 1) * dec) + t.fixed_s
    return Estimate(pre, dec, block, t.sequences * t.gen_len / block,
                    {name: lin.at(x) for name, lin in t.memory.items()})


def policy_terms(policy: Policy, shape: ModelShape, work: Workload, machine: Machine) -> Terms:
    """The terms of ``policy``'s blocks as they run ``work`` (a job of fewer sequences than a block runs
    one block of only those: see ``terms``)."""
    return terms(shape, work, machine, policy.gpu_batch_size, policy.num_gpu_batches, compress=policy.compress_kv,
                 overlap=policy.overlap, weight_dtype=policy.weight_dtype, rows=work.num_sequences)


def predict(policy: Policy, shape: ModelShape, work: Workload, machine: Machine) -> Estimate:
    """Time per block and memory per tier of ``policy`` on ``machine``."""
    return evaluate(policy_terms(policy, shape, work, machine), fractions(policy))


def compute_s(t: Terms, x: dict[str, float], steps: int) -> float:
    """The compute thread's time (layers and head) of a block's first ``steps`` token steps.

    Compute alone, except on a CPU-only machine with overlap: the loader threads then copy on the
    compute's cores while it runs, and the runner measured the compute 1.5-2x slower with them
    (a 0.3B layer at 32 rows: 27-47 ms overlapped, 17.4-17.9 ms serial), so its time covers both."""
    per_layer = t.thread["prefill"].at(x) + (steps - 1) * t.thread["decode"].at(x)
    return t.layers * per_layer + steps * t.fixed_s / t.gen_len


def slowed(m: Machine, factor: float) -> Machine:
    """``m`` with its cores ``factor`` times slower: compute, and the host copies that share the cores
    on a CPU-only machine (disk links keep their rates)."""
    cores = factor if m.copies_on_compute else 1.0
    return replace(m, layer_s=lambda rows: m.layer_s(rows) * factor,
                   attention_s=lambda b, q, k: m.attention_s(b, q, k) * factor,
                   head_s=lambda rows: m.head_s(rows) * factor, memcpy=m.memcpy / cores, dequant=m.dequant / factor,
                   convert={k: v / cores for k, v in m.convert.items()})


def placement_of(x: dict[str, float], prefix: str) -> Placement:
    g, c, d = (max(0.0, x[prefix + s]) for s in "gcd")
    total = g + c + d
    return Placement(g / total, c / total, d / total)
