"""What a request brings to a session, checked before any work: a prompt (chat messages, text or token
ids), a document's text, token ids, a prompt's length. A mistake is a ConfigError that names it."""
from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError
from tierkv.model.loading import LoadedModel
from tierkv.model.prompt import chat_ids, read_document

Message = dict[str, str]


class PromptTooLong(ConfigError):
    """A prompt longer than the session takes (``Session(max_prompt_tokens=...)``)."""


def prompt_ids(loaded: LoadedModel, kind: str, prompt: Any, tokenizer: Any = None) -> list[int]:
    """The token ids a request's prompt runs as, checked: ``kind`` "chat" (messages, in the model's chat
    template) or "completion" (text, or token ids). ``tokenizer``: another copy of the model's."""
    tokenizer = tokenizer or loaded.tokenizer
    if kind == "chat":
        check_messages(prompt)
        return chat_ids(tokenizer, list(prompt))
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (str, Iterable)):
        raise ConfigError(f"the prompt: expected text (a str) or token ids (a list of ints), got "
                          f"{type(prompt).__name__}")
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
    ids = list(prompt) if not isinstance(prompt, str) else tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError("the prompt is empty")
    return check_token_ids(ids, loaded.spec.vocab)


def document_text(document: str | Path) -> str:
    """The text of ``Session.read``'s document: a Path's file read, a str taken as the text itself (one
    that names a file is refused: ``read("report.txt")`` means the file)."""
    if isinstance(document, Path):
        return read_document(document, named="the document")
    if not isinstance(document, str):
        raise ConfigError(f"read(): the document is a str (its text) or a Path (a text file), not "
                          f"{type(document).__name__}")
    if "\n" not in document and len(document) < 4096 and os.path.isfile(document):
        raise ConfigError(f"read({document!r}): a str is the document's text, and this one is a file's name: "
                          f"read(Path({document!r})) reads the file")
    return document


def check_length(ids: Sequence[int], most: int | None) -> None:
    if most is not None and len(ids) > most:
        raise PromptTooLong(f"the prompt has {len(ids)} tokens; at most {most} are taken "
                            "(tierkv serve --max-prompt-tokens)")


def check_token_ids(ids: Sequence[int], vocab: int, what: str = "prompt") -> list[int]:
    """``ids`` as ints (numpy's taken too); a ConfigError naming the first that is no integer, or outside
    the model's vocabulary (0..vocab-1)."""
    bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)), None)
    if bad is not None:
        raise ConfigError(f"{what}: token id {bad!r} is a {type(bad).__name__}, not an integer (a tensor's ids: "
                          ".tolist())")
    ids = [int(i) for i in ids]
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise ConfigError(f"{what}: token id {bad!r} is not in the model's vocabulary; ids are 0..{vocab - 1}")
    return ids


def document_token_ids(ids: Any, vocab: int) -> list[int]:
    """A document given as token ids (``Session.read_ids``), checked as a prompt's are."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable) or not (ids := list(ids)):
        raise ConfigError(f"the document's token ids: expected a non-empty list of ints, got {ids!r:.60}")
    return check_token_ids(ids, vocab, what="the document")


def check_messages(messages: Sequence[Message]) -> None:
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
        raise ConfigError(f"messages: expected a list of {{'role': ..., 'content': ...}} dicts, got "
                          f"{type(messages).__name__} (ask() takes a question as text)")
    if not messages:
        raise ConfigError("messages: at least one message is needed")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or \
                not isinstance(m.get("content"), str):
            raise ConfigError(f"messages[{i}]: expected {{'role': 'system'|'user'|'assistant', 'content': "
                              f"text}}, got {m!r}")
        check_text(m["content"], f"messages[{i}]")
        if m.get("name") is not None:         # (a participant's name: templates that show it tokenize it)
            if not isinstance(m["name"], str):
                raise ConfigError(f"messages[{i}]: 'name': expected text (a str), got {type(m['name']).__name__}")
            check_text(m["name"], f"messages[{i}]'s name")


def check_text(text: str, what: str) -> None:
    """That ``text`` is Unicode a tokenizer takes: a lone surrogate (bytes that were not UTF-8, read with
    ``errors="surrogateescape"``, as a terminal's input is in a C locale) names its byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = ord(text[error.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"a lone surrogate U+{char:04X}"
        raise ConfigError(f"{what}: not UTF-8 text ({byte} at character {error.start})") from None
