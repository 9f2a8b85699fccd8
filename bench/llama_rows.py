"""llama.cpp as a measured peer of the decode rows: the same GGUF, the same prompt ids, the same threads.

Through llama-cpp-python (``pip install -e '.[bench]'``; it builds llama.cpp from source, ~15 min on
2 cores). Where it does not import, the rows are skipped and the report says so. On a CPU with AMX,
llama.cpp's weight repacking crashes this build, so the model is opened with ``use_extra_bufts``
off there. A long prompt's prefill (32K: ~13 min on 2 cores) runs once: its state is saved beside
the sparse store and loaded by later runs.
"""
from __future__ import annotations

import contextlib
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import xxhash


def version() -> str | None:
    """llama-cpp-python's version, or None where it does not import."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def context_for(prompt: int, steps: int) -> int:
    """llama.cpp's context for ``prompt`` tokens and ``steps`` timed ones (untimed warm-up and re-warm
    steps included), rounded up to a multiple of ``CONTEXT_ROUND``: a saved prompt state is keyed by
    the context, so one prefill then serves every step count that fits, not only the run's own."""
    return -(-(prompt + 2 * steps + 16) // CONTEXT_ROUND) * CONTEXT_ROUND


CONTEXT_ROUND = 1024


def kv_bytes(spec, tokens: int) -> int:
    """Bytes of llama.cpp's KV cache (f16 K and V) over ``tokens`` tokens of a model of ``spec``."""
    return tokens * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2


def repacking_off() -> bool:
    """AMX here: llama.cpp's repacked weight buffers crash, so they stay off."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


@contextlib.contextmanager
def _model_params(**fields):
    """llama-cpp-python's ``Llama`` takes no ``use_extra_bufts``: its default model params get it here.
    ``Llama`` calls them through the bindings module (``llama_cpp.llama_cpp``), not the package, which
    holds a copy of the name: patching the package's would change nothing."""
    from llama_cpp import llama_cpp
    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        known = {field[0] for field in type(p)._fields_}
        for name, value in fields.items():
            if name not in known:   # a ctypes struct takes any attribute and ignores it
                raise RuntimeError(f"llama.cpp's model params have no field {name!r} in this version")
            setattr(p, name, value)
        return p

    llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = default


class LlamaDecoder:
    """A ``Decoder`` of bench/decode.py over llama.cpp: the prompt evaluated (or its saved state loaded:
    it holds the KV, not the logits, so the first step's token comes from the caller), then one
    ``eval`` of one token per step, greedy."""

    def __init__(self, gguf: Path, ids: list[int], n_ctx: int, threads: int, state_dir: Path | None = None) -> None:
        from llama_cpp import Llama
        extra = {"use_extra_bufts": False} if repacking_off() else {}
        with _model_params(**extra):
            self.llm = Llama(str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                             verbose=False)
        self.prefill_s, self.loaded_state = None, False
        state = None if state_dir is None else state_dir / f"llama-{_digest(gguf, ids, n_ctx)}.state"
        if state is not None and state.is_file():
            with state.open("rb") as f:
                self.llm.load_state(pickle.load(f))
            self.loaded_state = True
        else:
            start = time.perf_counter()
            self.llm.eval(ids)
            self.prefill_s = time.perf_counter() - start
            if state is not None:
                state.parent.mkdir(parents=True, exist_ok=True)
                part = state.with_suffix(".part")
                with part.open("wb") as f:
                    pickle.dump(self.llm.save_state(), f)
                part.rename(state)

    def _argmax(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def step(self, token: int) -> int:
        self.llm.eval([token])
        return self._argmax()

    def start_timing(self) -> None:
        pass

    def figures(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        self.llm.close()


def _digest(gguf: Path, ids: list[int], n_ctx: int) -> str:
    h = xxhash.xxh3_64()
    stat = gguf.stat()
    h.update(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{n_ctx}|{version()}|".encode())
    h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return h.hexdigest()
