"""What a layer keeps on hand to choose chunks: summaries, and outliers kept exact.

Chunk c of the indexed region holds ``chunk_tokens`` consecutive tokens.
For each chunk the index keeps, in the frame selection scores in (post-RoPE
keys at their real positions, or pre-RoPE keys when positions are remapped)::

    landmarks [C, Hkv, D]   mean key, in the index's dtype          (ShadowKV selector)
                            or int8 codes with a float16 scale [C, Hkv] (tierkv.scoring)
    lo, hi    [C, Hkv, D]   per-dimension min / max key, float32    (Quest selector)
    candidates [C] bool     False for outlier chunks

Outliers: a chunk whose keys point away from their own mean (lowest minimum
cosine similarity to the landmark, over tokens and heads) is the one a
landmark describes worst; the ``target`` most extreme ones are kept exact
(pre-RoPE keys and values, in memory) and attended every step instead of
competing for selection. The target grows with the context, so the set is
re-ranked as chunks arrive: a newcomer more extreme than the weakest outlier
takes its place, and the weakest goes back to being a candidate (its page
holds it like every other chunk).
"""
from __future__ import annotations

import torch
from torch import Tensor

from tierkv.scoring import longest_landmark, quantize_landmarks

SUMMARIES = ("landmarks", "bounds")
SUMMARY_ROWS = ("_landmarks", "_scale", "_lo", "_hi", "_candidates")     # one row per chunk each


class _Growing:
    """Rows [n, *tail] appended to a tensor that grows by a quarter (the landmarks of 1M tokens are
    1.5 GB). ``axis`` is where the rows lie in storage: landmarks [n, H, D] are kept as
    [H, capacity, D] (``axis=1``), so each head's rows are contiguous and scoring a query against
    them is one strided batched matmul with no copy (row-major storage costs a transpose of every
    landmark at every step: 4x the time at 128K). ``rows`` is always [n, *tail], a view."""

    def __init__(self, tail: tuple[int, ...], dtype: torch.dtype, axis: int = 0) -> None:
        shape = list(tail)
        shape.insert(axis, 64)
        self.data, self.axis, self.n = torch.empty(shape, dtype=dtype), axis, 0
        self.owned = True          # False: ``data`` is shared with a fork; copied before a write
        self._end = [0]            # shared by the forks of ``data``: the rows any of them has written

    def fork(self) -> _Growing:
        """A branch sharing this storage. The first of the two to append after the rows written so
        far appends in place (a question's branch of a stored 1M document: no copy of its 1.5 GB of
        landmarks); any other write copies the storage first."""
        twin = object.__new__(_Growing)
        twin.data, twin.axis, twin.n, twin._end = self.data, self.axis, self.n, self._end
        self.owned = twin.owned = False
        return twin

    def own(self) -> None:
        """Make ``data`` this branch's own before writing into it."""
        if not self.owned:
            self.resize(self.capacity)

    def extend(self, rows: Tensor) -> None:
        need = self.n + rows.shape[0]
        after_all = self._end[0] == self.n          # no branch has written past these rows
        if need > self.capacity or not (self.owned or after_all):
            self.resize(max(need, self.capacity * 5 // 4 if need > self.capacity else self.capacity))
        self.data.narrow(self.axis, self.n, rows.shape[0]).copy_(rows.movedim(0, self.axis))
        self.n = self._end[0] = need

    def adopt(self, data: Tensor) -> None:
        """Take ``data`` (laid out as storage is, every row used) as the whole content, without a copy."""
        def tail(t: Tensor) -> tuple[int, ...]:      # the shape of one row
            return tuple(t.shape[:self.axis] + t.shape[self.axis + 1:])
        if data.dim() != self.data.dim() or tail(data) != tail(self.data):
            raise ValueError(f"rows of shape {tuple(data.shape)} do not fit storage {tuple(self.data.shape)} "
                             f"(rows along dimension {self.axis})")
        self.data, self.n = data.to(self.data.dtype).contiguous(), data.shape[self.axis]
        self.owned, self._end = True, [self.n]

    def adopt_parts(self, parts: list[Tensor], room: int) -> None:
        """Take the slices of storage along its first dimension (a head's landmarks [n, D] each) as
        the whole content, copied once into storage with ``room`` rows to grow into."""
        n = parts[0].shape[0] if parts else 0
        shape = list(self.data.shape)
        shape[0], shape[self.axis] = len(parts), n + room
        self.data = torch.empty(shape, dtype=self.data.dtype)
        for into, part in zip(self.data, parts):
            into.narrow(self.axis - 1, 0, n).copy_(part)
        self.n, self.owned, self._end = n, True, [n]

    def resize(self, rows: int) -> None:
        shape = list(self.data.shape)
        shape[self.axis] = max(rows, self.n)
        grown = torch.empty(shape, dtype=self.data.dtype)
        grown.narrow(self.axis, 0, self.n).copy_(self.data.narrow(self.axis, 0, self.n))
        self.data, self.owned, self._end = grown, True, [self.n]

    @property
    def capacity(self) -> int:
        return self.data.shape[self.axis]

    @property
    def rows(self) -> Tensor:
        return self.data.narrow(self.axis, 0, self.n).movedim(self.axis, 0)


class ChunkIndex:
    """Chunk summaries and exact outliers of one layer (a ``tierkv.policy.ChunkView``)."""

    def __init__(self, layer: int, heads: int, head_dim: int, *, chunk_tokens: int, needs: frozenset[str],
                 dtype: torch.dtype, int8_landmarks: bool = False) -> None:
        unknown = set(needs) - set(SUMMARIES)
        if unknown:
            raise ValueError(f"needs={sorted(unknown)}: an index keeps only {', '.join(SUMMARIES)}")
        self.layer, self.chunk_tokens = layer, chunk_tokens
        shape = (heads, head_dim)
        landmarks = "landmarks" in needs
        self._landmarks = _Growing(shape, torch.int8 if int8_landmarks else dtype, axis=1) if landmarks else None
        self._scale = _Growing((heads,), torch.float16, axis=1) if landmarks and int8_landmarks else None
        # bounds stay float32: rounding them to a narrower dtype could move a bound inside its keys
        self._lo = _Growing(shape, torch.float32) if "bounds" in needs else None
        self._hi = _Growing(shape, torch.float32) if "bounds" in needs else None
        self._candidates = _Growing((), torch.bool)
        self.outliers: dict[int, tuple[float, Tensor, Tensor]] = {}   # chunk -> (score, k_pre, v)
        self._exact: tuple[Tensor, Tensor, Tensor] | None = None
        self._by_head: tuple[Tensor, Tensor, Tensor] | None = None   # (exact()'s K, then K, V by head)
        self._norm: Tensor | None = torch.zeros(heads)     # [Hkv]: no landmark is longer (None: not known)

    def fork(self) -> ChunkIndex:
        """A branch of this index: summaries shared (the first side to grow them after the shared rows
        does so in place, the other copies them first), outliers its own."""
        twin = object.__new__(ChunkIndex)
        twin.layer, twin.chunk_tokens = self.layer, self.chunk_tokens
        for name in SUMMARY_ROWS:
            grow = getattr(self, name)
            setattr(twin, name, None if grow is None else grow.fork())
        twin.outliers, twin._exact, twin._norm = dict(self.outliers), self._exact, self._norm
        twin._by_head = self._by_head
        return twin

    def reserve(self, chunks: int) -> None:
        """Room for ``chunks`` (a long prompt's, known up front); a branch's shared summaries are left
        as they are: they are copied, with room to grow, when the branch first extends them."""
        for grow in self._summaries():
            if grow.owned and grow.capacity < chunks:
                grow.resize(chunks)

    # -- the ChunkView a selector reads ------------------------------------------
    @property
    def chunks(self) -> int:
        return self._candidates.n

    @property
    def landmarks(self) -> Tensor | None:
        return None if self._landmarks is None else self._landmarks.rows

    @property
    def landmark_norm(self) -> Tensor | None:
        """[Hkv] float32: no landmark of a head is longer (an upper bound: it stays valid when the
        index is cut back), for `tierkv.scoring.top_landmark_chunks`; None without float landmarks."""
        if self._landmarks is None or self._scale is not None:
            return None
        if self._norm is None:
            self._norm = longest_landmark(self.landmarks)
        return self._norm

    @property
    def landmark_scale(self) -> Tensor | None:
        return None if self._scale is None else self._scale.rows

    @property
    def lo(self) -> Tensor | None:
        return None if self._lo is None else self._lo.rows

    @property
    def hi(self) -> Tensor | None:
        return None if self._hi is None else self._hi.rows

    @property
    def candidates(self) -> Tensor:
        return self._candidates.rows

    # -- growing ------------------------------------------------------------------
    def add(self, keys: Tensor, k_pre: Tensor, v: Tensor, target_outliers: int) -> None:
        """Index new whole chunks: keys [t, Hkv, D] in the scoring frame, k_pre / v [t, Hkv, D] exact."""
        c = self.chunk_tokens
        chunked = keys.float().view(-1, c, *keys.shape[1:])           # [n, c, Hkv, D]
        means = chunked.mean(dim=1)                                   # [n, Hkv, D]
        first = self.chunks
        if self._scale is not None:
            codes, scale = quantize_landmarks(means)
            self._landmarks.extend(codes)
            self._scale.extend(scale)
        elif self._landmarks is not None:
            stored = means.to(self._landmarks.data.dtype)
            self._landmarks.extend(stored)
            if self._norm is not None:
                self._norm = torch.maximum(self._norm, longest_landmark(stored))
        if self._lo is not None:
            self._lo.extend(chunked.amin(dim=1).to(self._lo.data.dtype))
            self._hi.extend(chunked.amax(dim=1).to(self._hi.data.dtype))
        self._candidates.extend(torch.ones(chunked.shape[0], dtype=torch.bool))
        cosine = torch.nn.functional.cosine_similarity(chunked, means.unsqueeze(1), dim=-1)  # [n, c, Hkv]
        scores = cosine.flatten(1).amin(dim=1)                                                # [n]
        self._rank_outliers(first, scores, k_pre.view(-1, c, *k_pre.shape[1:]), v.view(-1, c, *v.shape[1:]),
                            target_outliers)

    def _rank_outliers(self, first: int, scores: Tensor, k_pre: Tensor, v: Tensor, target: int) -> None:
        old = list(self.outliers)
        pool = torch.cat([torch.tensor([self.outliers[i][0] for i in old]), scores])
        keep = set(pool.topk(min(target, pool.numel()), largest=False).indices.tolist())
        self._candidates.own()
        for rank, chunk in enumerate(old):
            if rank not in keep:
                del self.outliers[chunk]
                self._candidates.data[chunk] = True
        for offset in range(scores.numel()):
            if len(old) + offset in keep:
                chunk = first + offset
                self.outliers[chunk] = (float(scores[offset]), k_pre[offset].clone(), v[offset].clone())
                self._candidates.data[chunk] = False
        self._exact = None

    def exact(self) -> tuple[Tensor, Tensor, Tensor]:
        """Outliers in chunk order: (chunk ids [m], k_pre [m*c, Hkv, D], v [m*c, Hkv, D])."""
        if self._exact is None:
            ids = sorted(self.outliers)
            if ids:
                k = torch.cat([self.outliers[i][1] for i in ids])
                v = torch.cat([self.outliers[i][2] for i in ids])
            else:
                k = v = torch.empty(0)
            self._exact = (torch.tensor(ids, dtype=torch.long), k, v)
        return self._exact

    def exact_by_head(self) -> tuple[Tensor, Tensor]:
        """The outliers' K and V by KV head, a chunk's tokens one row: [Hkv, m, c * D] each, in chunk order;
        made once per outlier set (a gathered context writes them whole chunks at a time)."""
        ids, k, v = self.exact()
        if self._by_head is None or self._by_head[0] is not k:
            m, c = len(ids), self.chunk_tokens
            k_h, v_h = (x.view(m, c, *x.shape[1:]).permute(2, 0, 1, 3).reshape(x.shape[1], m, -1) for x in (k, v))
            self._by_head = (k, k_h, v_h)
        return self._by_head[1], self._by_head[2]

    def memory_bytes(self) -> int:
        """Bytes held in memory: summaries (allocated, with growth room) and exact outliers (and their
        copy by head, once a gather made it)."""
        total = sum(g.data.numel() * g.data.element_size() for g in self._summaries())
        by_head = 0 if self._by_head is None else self._by_head[1].nbytes + self._by_head[2].nbytes
        return total + by_head + sum(k.nbytes + v.nbytes for _, k, v in self.outliers.values())

    # -- persistence ----------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """What the index holds, as views that need no copy to be saved: the landmarks one tensor per
        KV head ("landmarks.h<j>" [n, D], contiguous in storage), the rest [n, ...] row prefixes."""
        ids, k, v = self.exact()
        state = {"candidates": self.candidates, "outlier_ids": ids, "outlier_scores":
                 torch.tensor([self.outliers[i][0] for i in ids.tolist()], dtype=torch.float32)}
        if ids.numel():
            state |= {"outlier_k": k, "outlier_v": v}
        for name, grow in (("landmarks", self._landmarks), ("landmark_scale", self._scale)):
            if grow is not None:
                data, n = grow.data, grow.n
                state |= {f"{name}.h{h}": data[h, :n] for h in range(data.shape[0])}
        for name in ("lo", "hi"):
            if getattr(self, name) is not None:
                state[name] = getattr(self, name)
        return state

    def load(self, state: dict[str, Tensor]) -> None:
        """Take the content of ``state()`` (or of the older layout with one "landmarks" [n, H, D]),
        adopting its tensors where their layout allows."""
        if self._landmarks is not None:
            heads = self._landmarks.data.shape[0]
            stored = state.get("landmarks.h0", state.get("landmarks"))
            if stored is not None and (stored.dtype == torch.int8) != (self._scale is not None):
                raise ValueError(f"the stored landmarks are {stored.dtype}, this index keeps "
                                 f"{'int8' if self._scale is not None else self._landmarks.data.dtype}")
            if all(f"landmarks.h{h}" in state for h in range(heads)):
                parts = [state[f"landmarks.h{h}"] for h in range(heads)]
                self._landmarks.adopt_parts(parts, room=max(64, parts[0].shape[0] // 64))   # decode grows it
            elif "landmarks" in state:
                self._landmarks.adopt(state["landmarks"].transpose(0, 1))
            else:
                raise KeyError("the stored index has no landmarks")
            self._norm = None
        if self._scale is not None:
            heads = self._scale.data.shape[0]
            if not all(f"landmark_scale.h{h}" in state for h in range(heads)):
                raise KeyError("the stored index has no landmark scales")
            self._scale.adopt(torch.stack([state[f"landmark_scale.h{h}"] for h in range(heads)]))
        for name, grow in (("lo", self._lo), ("hi", self._hi)):
            if grow is not None:
                if name not in state:
                    raise KeyError(f"the stored index has no {name}")
                grow.adopt(state[name])
        self._candidates.adopt(state["candidates"])
        if len({g.n for g in self._summaries()}) != 1:
            raise ValueError("the stored summaries disagree on the number of chunks")
        self._load_outliers(state)

    @classmethod
    def prefix_of(cls, index: ChunkIndex, chunks: int, saved: dict[str, Tensor]) -> ChunkIndex:
        """``index`` as it was when it held ``chunks`` chunks: its summaries' first rows (shared, copied
        on growth), the candidate flags and outliers of then from ``saved`` (a restore point)."""
        twin = index.fork()
        for grow in (twin._landmarks, twin._scale, twin._lo, twin._hi):
            if grow is not None:
                if grow.n < chunks:
                    raise ValueError(f"a restore point of {chunks} chunks, the index has {grow.n}")
                grow.n = chunks
        twin._candidates = _Growing((), torch.bool)
        twin._candidates.adopt(saved["candidates"])
        if twin._candidates.n != chunks:
            raise ValueError(f"{twin._candidates.n} candidate flags for {chunks} chunks")
        twin._load_outliers(saved)
        return twin

    def _summaries(self) -> list[_Growing]:
        return [g for g in (getattr(self, name) for name in SUMMARY_ROWS) if g is not None]

    def _load_outliers(self, state: dict[str, Tensor]) -> None:
        c = self.chunk_tokens
        ids, scores = state["outlier_ids"].tolist(), state["outlier_scores"].tolist()
        self.outliers = {chunk: (score, state["outlier_k"][j * c:(j + 1) * c].clone(),
                                 state["outlier_v"][j * c:(j + 1) * c].clone())
                         for j, (chunk, score) in enumerate(zip(ids, scores))}
        self._exact = None
