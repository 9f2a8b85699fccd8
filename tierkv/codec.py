"""Quantized KV: int8, int4 and int2 codes in groups, each group with its own scale and minimum.

One codec serves every path that stores KV (dense blocks, sparse pages, the batch schedule's
blocks). A field of shape ``[..., T, C]`` (T tokens, C channels: a head's dims, or the low-rank key
factors) is quantized in groups along one of its two last axes, as KIVI does::

    per token    groups of G channels of one token       values: an outlier token does not blur the rest
    per channel  groups of G tokens of one channel       keys: a few channels are large in every token

    lo    = min(group)                   (rounded down to the scale dtype)
    scale = (max(group) - lo) / (2^b - 1)  (rounded up: the top value stays reachable)
    code  = round((x - lo) / scale)      in 0 .. 2^b - 1        x' = lo + code * scale
    |x - x'| <= scale / 2

Bytes of a field, back to back (each part a multiple of 4 bytes, so the next one is aligned)::

    codes [..., T, C * b / 8]   token-major: the codes of one token are contiguous; byte j holds
                                channels j, j + C*b/8, j + 2*C*b/8, ... (low bits first), so
                                unpacking is a few shifts and one concatenation, no interleave
    scale [..., T, C / G]  or  [..., T / G, C]    in the scale dtype
    lo    (the same shape)

Token-major codes let a read decode only the rows it gathers (``take``): the selected tokens'
codes and their groups' scales, never the whole block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tierkv.errors import ConfigError

BITS = {"int8": 8, "int4": 4, "int2": 2}
AXES = ("token", "channel")
SCALES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _align4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True, slots=True)
class Quant:
    """``bits``-bit codes in groups of ``group`` along ``axis`` (a ``tierkv.layout.Codec``)."""

    bits: int
    axis: str = "token"                      # token: groups along C; channel: groups along T
    group: int = 64
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.bits not in BITS.values():
            raise ConfigError(f"bits={self.bits}: allowed: {', '.join(map(str, BITS.values()))}")
        if self.axis not in AXES:
            raise ConfigError(f"axis={self.axis!r}: allowed: {', '.join(AXES)}")
        if self.group <= 0:
            raise ConfigError(f"group={self.group}: must be > 0")

    @property
    def name(self) -> str:
        """Names the encoding in store names: a store written with one codec is never read as another."""
        scale = next(name for name, dtype in SCALES.items() if dtype == self.scale_dtype)
        return f"int{self.bits}{self.axis[0]}{self.group}{scale}"

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    # -- shapes and sizes -----------------------------------------------------------------
    def check(self, shape: tuple[int, ...]) -> None:
        """Raise unless a field of ``shape`` [..., T, C] divides into this codec's groups and bytes."""
        if len(shape) < 2:
            raise ConfigError(f"a quantized field needs [..., tokens, channels], not {shape}")
        T, C = shape[-2:]
        along = C if self.axis == "token" else T
        if along % self.group:
            raise ConfigError(f"-g{self.group}: must divide the {along} channels of a head" if self.axis == "token"
                              else f"group={self.group}: must divide the {along} tokens a key scale spans")
        if C % self.per_byte:
            raise ConfigError(f"{C} channels do not pack {self.per_byte} {self.bits}-bit codes per byte")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, T, C = shape
        return (*lead, T, C // self.group) if self.axis == "token" else (*lead, T // self.group, C)

    def parts(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(bytes of the codes, bytes of one scale array) of a field of ``shape``."""
        self.check(shape)
        return (_align4(math.prod(shape) // self.per_byte),
                _align4(math.prod(self.scale_shape(shape)) * self.scale_dtype.itemsize))

    def nbytes(self, shape: tuple[int, ...]) -> int:
        codes, scales = self.parts(shape)
        return codes + 2 * scales

    # -- encode -----------------------------------------------------------------------------
    def encode(self, x: Tensor, out: Tensor | None = None, *, blocks: int = 0) -> Tensor:
        """x [..., T, C] -> uint8 [nbytes(x.shape)] (``out``: written there); ``blocks``: the first
        dimensions of ``x`` are blocks, each encoded on its own: -> [*those dimensions, nbytes]."""
        lead, shape = tuple(x.shape[:blocks]), tuple(x.shape[blocks:])
        n_codes, n_scales = self.parts(shape)
        raw = torch.zeros(*lead, n_codes + 2 * n_scales, dtype=torch.uint8) if out is None else out
        grouped = self._groups(x.float())                                 # [..., groups, G]
        lo, scale = self._scales(grouped)
        codes = ((grouped - lo) / scale).round_().clamp_(0, self.levels).to(torch.uint8)
        codes = self._ungroup(codes, tuple(x.shape))                      # [..., T, C]
        codes = codes.view(*x.shape[:-1], self.per_byte, shape[-1] // self.per_byte)
        packed = codes[..., 0, :].clone()
        for i in range(1, self.per_byte):
            packed |= codes[..., i, :] << (i * self.bits)
        packed = packed.reshape(*lead, -1)
        raw[..., :packed.shape[-1]].copy_(packed)
        for at, part in ((n_codes, scale), (n_codes + n_scales, lo)):
            flat = part.to(self.scale_dtype).reshape(*lead, -1).view(torch.uint8)
            raw[..., at:at + flat.shape[-1]].copy_(flat)
        return raw

    def _groups(self, x: Tensor) -> Tensor:
        """[..., T, C] -> [..., groups, G]: the values of each group contiguous."""
        *lead, T, C = x.shape
        if self.axis == "token":
            return x.reshape(*lead, T, C // self.group, self.group)
        return x.reshape(*lead, T // self.group, self.group, C).transpose(-1, -2)   # [..., T/G, C, G]

    def _ungroup(self, g: Tensor, shape: tuple[int, ...]) -> Tensor:
        if self.axis == "token":
            return g.reshape(shape)
        return g.transpose(-1, -2).reshape(shape)

    def _scales(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """Each group's minimum and step, as stored (rounded so that every value stays in range)."""
        lo32, hi32 = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        down, up = torch.full_like(lo32, -math.inf), torch.full_like(lo32, math.inf)
        lo = lo32.to(self.scale_dtype)
        lo = torch.where(lo.float() > lo32, torch.nextafter(lo, down.to(self.scale_dtype)), lo).float()
        step = ((hi32 - lo) / self.levels).clamp_min(1e-30)
        scale = step.to(self.scale_dtype)
        scale = torch.where(scale.float() < step, torch.nextafter(scale, up.to(self.scale_dtype)), scale).float()
        if not (torch.isfinite(scale).all() and torch.isfinite(lo).all()):
            if not (torch.isfinite(lo32).all() and torch.isfinite(hi32).all()):
                raise ConfigError("KV values with NaN or inf (the model's computation overflowed; a wider --dtype "
                                  "may help): they cannot be quantized")
            raise ConfigError(f"KV values out of the range of scale dtype {self.scale_dtype}: "
                              "use a wider one (-sf32)")
        return lo, scale.clamp_min(torch.finfo(self.scale_dtype).tiny)

    # -- decode -----------------------------------------------------------------------------
    def decode(self, raw: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """uint8 [..., nbytes(shape[-k:])] -> the field [*shape] in ``dtype``; ``shape`` may lead with
        block dimensions that ``raw`` leads with too."""
        lead = tuple(raw.shape[:-1])
        codes, scale, lo = self._views(raw, shape[len(lead):])
        values = self._unpack(codes)                                        # [*lead, ..., T, C] float
        return self._apply(values, scale, lo, shape[len(lead):], lead).to(dtype)

    def take(self, raw: Tensor, shape: tuple[int, ...], index: tuple[Tensor, ...]) -> Tensor:
        """Rows of blocks ``raw`` [n, nbytes] holding fields of ``shape`` [..., T, C], decoded only
        where ``index`` points: ``index`` has one tensor per dimension of [n, ..., T] (broadcast
        together, the T index among them) -> float32 [*index shape, C]."""
        codes, scale, lo = self._views(raw, shape)
        rows = self._unpack(codes[index])                                   # [*idx, C]
        if self.axis == "token":
            step, low = scale[index].float().unsqueeze(-1), lo[index].float().unsqueeze(-1)   # [*idx, C/G, 1]
            return torch.addcmul(low, rows.unflatten(-1, (-1, self.group)), step).flatten(-2)
        group = self._group_index(index)
        return torch.addcmul(lo[group].float(), rows, scale[group].float())   # [*idx, C]

    def _group_index(self, index: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The scale rows of ``index`` (per channel: token t is in group t // G). Rows laid out
        [..., chunk, token of chunk] whose tokens share their group take one scale row per chunk,
        broadcast: a scale gathered per token costs more than the codes' own decode."""
        *head, t = index
        group = t // self.group
        first = group[..., :1]
        if group.shape[-1] > 1 and all(h.shape[-1] == 1 for h in head if h.dim()) \
                and torch.equal(group, first.expand_as(group)):
            group = first
        return (*head, group)

    def _views(self, raw: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
        """Views of the codes [*lead, ..., T, C/per_byte], scale and lo in ``raw`` [*lead, nbytes]."""
        lead = tuple(raw.shape[:-1])
        n_codes, n_scales = self.parts(shape)
        packed = (*shape[:-1], shape[-1] // self.per_byte)
        sshape = self.scale_shape(shape)
        size = math.prod(sshape) * self.scale_dtype.itemsize
        codes = raw[..., :math.prod(packed)].view(*lead, *packed)
        scale = raw[..., n_codes:n_codes + size].view(self.scale_dtype).view(*lead, *sshape)
        lo = raw[..., n_codes + n_scales:n_codes + n_scales + size].view(self.scale_dtype).view(*lead, *sshape)
        return codes, scale, lo

    def _unpack(self, codes: Tensor) -> Tensor:
        """uint8 [..., C/per_byte] -> float32 codes [..., C]."""
        if self.per_byte == 1:
            return codes.float()
        parts = [codes & self.levels, *((codes >> (i * self.bits)) & self.levels for i in range(1, self.per_byte - 1)),
                 codes >> (8 - self.bits)]
        return torch.cat(parts, dim=-1).float()

    def _apply(self, values: Tensor, scale: Tensor, lo: Tensor, shape: tuple[int, ...],
               lead: tuple[int, ...]) -> Tensor:
        """codes [*lead, ..., T, C] -> lo + code * scale, per group."""
        *inner, T, C = shape
        if self.axis == "token":
            g = values.view(*lead, *inner, T, C // self.group, self.group)
            return (lo.float().unsqueeze(-1) + g * scale.float().unsqueeze(-1)).reshape(*lead, *shape)
        g = values.view(*lead, *inner, T // self.group, self.group, C)
        return (lo.float().unsqueeze(-2) + g * scale.float().unsqueeze(-2)).reshape(*lead, *shape)

    def step_bound(self, raw: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Half the step of each value's group, [*shape]: the most a value may have moved."""
        _, scale, _ = self._views(raw, shape)
        half = scale.float() / 2
        T, C = shape[-2:]
        if self.axis == "token":
            return half.unsqueeze(-1).expand(*half.shape, self.group).reshape(*raw.shape[:-1], *shape)
        return half.unsqueeze(-2).expand(*half.shape[:-2], T // self.group, self.group, C).reshape(
            *raw.shape[:-1], *shape)


# -- what a run asks for -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVCodec:
    """How a path stores K and V: keys per channel, values per token (KIVI), at ``bits`` bits; named
    on the command line as ``int4``, ``int8-g32``, ``int2-sbf16`` (``parse``).

    ``key_group`` tokens share a key channel's scale (None: every token of the field, a sparse
    page or a dense block); ``value_group`` channels share a token's scale (None: a head's dims)."""

    bits: int
    key_group: int | None = None
    value_group: int | None = None
    scale_dtype: torch.dtype = torch.float16

    @classmethod
    def parse(cls, text: str | None, *, key_group: int | None = None) -> KVCodec | None:
        """``int4`` (or ``int8``, ``int2``), optionally ``-g<N>`` channels per value scale and ``-s<f16|bf16|f32>``
        scale dtype (``int4-g32-sbf16``) -> a codec; None or a float dtype name -> None (stored as is)."""
        if text is None or text in FLOAT_DTYPES:
            return None
        head, *options = text.split("-")
        if head not in BITS:
            raise ConfigError(f"{text!r}: allowed: {', '.join(FLOAT_DTYPES)}, or {'/'.join(BITS)} with optional "
                              "-g<channels per value scale> and -s<f16|bf16|f32> (like int4-g32)")
        group, scale = None, "f16"
        for n, option in enumerate(options):
            if option[:1] in {o[:1] for o in options[:n]}:
                raise ConfigError(f"{text!r}: option -{option[:1]} given twice; give each of -g<N> and -s<dtype> once")
            if option[:1] == "g" and option[1:].isdigit() and int(option[1:]) > 0:
                group = int(option[1:])
            elif option[:1] == "s" and option[1:] in SCALES:
                scale = option[1:]
            else:
                raise ConfigError(f"{text!r}: unknown option {option!r}; allowed: -g<N> (channels per value scale, "
                                  f"N > 0), -s<{'|'.join(SCALES)}> (scale dtype)")
        return cls(BITS[head], key_group, group, SCALES[scale])

    def approx_bytes(self, numel: int, head_dim: int) -> float:
        """About what ``numel`` values of K or V take (codes, and a scale and minimum per head vector)."""
        return numel * self.bits / 8 + numel / head_dim * 2 * self.scale_dtype.itemsize

    def keys(self, shape: tuple[int, ...]) -> Quant:
        """The codec of a key field [..., T, C]: per channel, in groups of ``key_group`` tokens."""
        return Quant(self.bits, "channel", self.key_group or shape[-2], self.scale_dtype)

    def values(self, shape: tuple[int, ...], head_dim: int) -> Quant:
        """The codec of a value field [..., T, C]: per token, in groups of ``value_group`` channels."""
        return Quant(self.bits, "token", self.value_group or head_dim, self.scale_dtype)


KEY_GROUP = 64      # tokens that share a key channel's scale in a dense block (KIVI's grouping)


def block_codec(text: str | None, block_tokens: int) -> KVCodec | None:
    """The codec ``text`` names for dense KV blocks of ``block_tokens``: keys per channel in groups of
    64 tokens (of the whole block when it is not a multiple of 64), values per token. A float dtype is
    refused: dense blocks are stored in the compute dtype (it was taken and changed nothing)."""
    if text is not None and text.split("-")[0] not in BITS:
        raise ConfigError(f"{text!r}: allowed: int8, int4 or int2 (lossy), with optional -g<channels per value "
                          "scale> and -s<f16|bf16|f32>; unquantized, dense KV blocks are stored in the dtype the model "
                          "computes in (--dtype on the command line)")
    return KVCodec.parse(text, key_group=KEY_GROUP if block_tokens % KEY_GROUP == 0 else None)
