"""Generating an answer from a state: sampling, stop strings, streamed text, and what it cost.

    logits = state.extend(prompt tokens)          time to first token ends here
    loop:  token = sampler(logits)                greedy at temperature 0, else top-p sampling
           stop at EOS, a stop string, max_new_tokens, or when cancelled
           text piece out (streamed)              held back while it could be the start of a stop string
           logits = state.step(token)

The text is decoded from all tokens so far and streamed as the difference, so a
character made of several tokens comes out whole.
"""
from __future__ import annotations

import hashlib
import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tierkv.errors import ConfigError
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.session.state import KVState


@dataclass(frozen=True, slots=True)
class Sampling:
    """How tokens are chosen: greedy at ``temperature`` 0, else softmax(logits / temperature) cut to
    the smallest set of tokens holding ``top_p`` of the mass; ``seed`` makes sampling repeatable."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    draft_tokens: int = 0           # greedy only: propose up to this many tokens by prompt lookup, verify in one pass

    @classmethod
    def of(cls, settings: dict[str, Any]) -> Sampling:
        """``Sampling(**settings)``, an unknown name a ConfigError that lists the known ones."""
        unknown = sorted(set(settings) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown sampling setting(s): {', '.join(unknown)}; allowed: "
                              f"{', '.join(f.name for f in fields(cls))}")
        return cls(**settings)

    def __post_init__(self) -> None:
        for name, kinds, said in (("max_new_tokens", numbers.Integral, "an integer"),
                                  ("draft_tokens", numbers.Integral, "an integer"),
                                  ("temperature", numbers.Real, "a number"), ("top_p", numbers.Real, "a number"),
                                  ("seed", (numbers.Integral, type(None)), "an integer or None")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ConfigError(f"{name}={value!r}: expected {said}")
            if isinstance(value, numbers.Integral):          # (numpy's integers too, as plain ints)
                object.__setattr__(self, name, int(value))
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError(f"stop={self.stop!r}: expected a sequence of strings")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not 0 <= self.temperature <= 100:
            raise ConfigError(f"temperature={self.temperature}: must be between 0 and 100")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ConfigError("stop: an empty stop string would stop at once")
        if self.draft_tokens < 0 or (self.draft_tokens and self.temperature):
            raise ConfigError(f"draft_tokens={self.draft_tokens}: drafts (>= 0) are verified against greedy "
                              "decoding only (temperature 0)")

    def sampler(self) -> Callable[[Tensor], int]:
        if self.temperature == 0:
            return lambda logits: int(logits.argmax())
        generator = torch.Generator()
        generator.manual_seed(_seed32(self.seed) if self.seed is not None else int(time.time_ns()) & 0xFFFFFFFF)
        return lambda logits: _sample(logits, self.temperature, self.top_p, generator)


def _seed32(seed: int) -> int:
    """The CPU generator's seed for ``seed``: its Mersenne Twister takes 32 bits, and cutting a 64-bit seed
    to its low ones would give seeds that differ only above them the same tokens. Seeds of 32 bits are
    taken as they are; larger or negative ones are hashed down."""
    if 0 <= seed < 1 << 32:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p          # the first token always stays
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(slots=True)
class Answer:
    """One answer and what it cost."""

    text: str = ""
    prompt_tokens: int = 0
    reused_tokens: int = 0              # prompt tokens served from stored KV
    generated_tokens: int = 0
    ttft_s: float = 0.0                 # from the request to the first token's logits
    decode_s: float = 0.0
    stall_s: float = 0.0                # decode time spent waiting on tier loads
    finish_reason: str = "length"       # stop (EOS or a stop string), length, or cancelled
    tokens: list[int] = field(default_factory=list)
    computed_from: int | None = None    # the first prompt position computed for this answer (None: none yet)
    drafted: int = 0                    # tokens proposed by prompt lookup (speculative decoding)
    accepted: int = 0                   # of those, what greedy decoding would have chosen
    report: dict[str, object] = field(default_factory=dict)   # what the sparse step did (sparse mode)
    mode: str = ""                      # the engine that answered: dense or sparse

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.stall_s / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict[str, object]:
        out = {name: getattr(self, name) for name in self.__slots__ if name not in ("tokens", "computed_from")}
        return out | {"decode_tokens_per_s": self.decode_tokens_per_s, "stall_fraction": self.stall_fraction}


def generate(state: KVState, logits: Tensor, answer: Answer, sampling: Sampling, *, tokenizer, eos: set[int],
             events: EventRecorder, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
    """Text pieces of the answer that follows ``logits``; fills ``answer`` as it goes."""
    shown, start = "", time.perf_counter()
    tokens = _speculative(state, logits, sampling.draft_tokens, answer, events) if sampling.draft_tokens else \
        _one_by_one(state, logits, sampling.sampler(), answer, events)
    try:
        for token in tokens:
            answer.tokens.append(token)
            answer.generated_tokens += 1
            text, stop = _cut(_text(tokenizer, answer.tokens), sampling.stop)
            if token in eos or stop:
                answer.finish_reason = "stop"
            safe = text if stop or token in eos else _held_back(text, sampling.stop)
            if len(safe) > len(shown):
                yield safe[len(shown):]
                shown = safe
            answer.text = text
            if answer.finish_reason == "stop" or answer.generated_tokens >= sampling.max_new_tokens:
                break
            if cancelled():
                answer.finish_reason = "cancelled"
                break
    except GeneratorExit:                  # the reader went away (a closed stream, a client that hung up)
        answer.finish_reason = "cancelled"
        raise
    finally:
        tokens.close()
        answer.decode_s = time.perf_counter() - start
    if len(answer.text) > len(shown):
        yield answer.text[len(shown):]


def _one_by_one(state: KVState, logits: Tensor, choose: Callable[[Tensor], int], answer: Answer,
                events: EventRecorder) -> Iterator[int]:
    """Each token chosen from the logits the step before left; the reader stops pulling when done. A
    step's stall is what its thread waited during it (answers on other threads wait on their own)."""
    while True:
        token = choose(logits)
        yield token
        step, waited = time.perf_counter(), events.waited()
        logits = state.step(token)
        answer.stall_s += events.waited() - waited
        events.record(Event(EventKind.STEP, "", "", None, 0, step, step, time.perf_counter()))


def _speculative(state: KVState, logits: Tensor, k: int, answer: Answer, events: EventRecorder) -> Iterator[int]:
    """Greedy decoding, several tokens a pass where a guess holds: the tokens that followed the last
    occurrence of the newest n-gram earlier in the sequence (prompt lookup) are verified in one
    pass; the longest run the model agrees with is kept, the rest cropped::

        token t, draft d1..dk     verify [t, d1..dk] -> greedy picks p0..pk
        keep d1..dm while d_i == p_(i-1); the next token is p_m     (same tokens as one by one)

    A draft is as long as the last one that held all through, twice that, at most ``k``; after a
    miss, one more than what held (a pass over a draft that fails costs more than a step).
    """
    token, size = int(logits.argmax()), k
    while True:
        draft = prompt_lookup([*state.tokens, token], size)
        step = time.perf_counter()
        if not draft:
            yield token
            waited = events.waited()
            token = int(state.step(token).argmax())
            answer.stall_s += events.waited() - waited
        else:
            waited = events.waited()
            picks = state.verify([token, *draft]).argmax(dim=-1).tolist()
            answer.stall_s += events.waited() - waited
            held = next((i for i, d in enumerate(draft) if d != picks[i]), len(draft))
            size = min(k, 2 * size) if held == len(draft) else held + 1
            state.crop(len(draft) - held)
            answer.drafted, answer.accepted = answer.drafted + len(draft), answer.accepted + held
            yield from [token, *draft[:held]]
            token = picks[held]
        events.record(Event(EventKind.STEP, "", "", None, 0, step, step, time.perf_counter()))


def prompt_lookup(tokens: Sequence[int], k: int, *, longest: int = 3, window: int = 1 << 16) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from ``longest`` down to 1), within its last ``window`` tokens; none when nothing repeats."""
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    for n in range(min(longest, len(seq) - 1), 0, -1):
        starts = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)      # every n-gram but the last one
        hits = np.flatnonzero((starts == seq[-n:]).all(axis=1))
        if hits.size:
            return seq[hits[-1] + n:hits[-1] + n + k].tolist()
    return []


def _text(tokenizer, tokens: list[int]) -> str:
    """The text of ``tokens`` (none for a model without a tokenizer: its answers are token ids)."""
    return "" if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True)


def _cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether there was one."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def _held_back(text: str, stops: Sequence[str]) -> str:
    """``text`` without a tail that could still grow into a stop string."""
    keep = len(text)
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                keep = min(keep, len(text) - n)
                break
    return text[:keep]
