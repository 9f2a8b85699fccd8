"""Prompts: a document and questions in the model's chat template, or a synthetic passkey haystack.

The synthetic haystack is the classic one: a repeated filler, a passkey
planted at a chosen depth, and a plain completion prompt. SmolLM2 at ~6K
tokens finds the key at every depth in this form; with real-text filler
(``filler="text"``, CPython's own documentation) or a chat-formatted
question it rarely does, so the filler is an option, not the default::

    [intro] [filler ...] [passkey sentence] [filler ...] [question]  -> "The pass key is"
            |<------ depth * filler tokens ---->|

Token ids are built by repeating the tokenised filler, so a 1M-token prompt
takes milliseconds, and the same arguments always give the same ids.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import ConfigError

INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the pass key.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
FILLERS = ("repeat", "text")
DEFAULT_QUESTION = "Summarize the document above in a few sentences."


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    answer: str | None = None   # the planted passkey, for synthetic prompts


def passkey_prompt(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0,
                   filler: str = "repeat") -> Prompt:
    """About ``n_tokens`` tokens of haystack with a 5-digit passkey at ``depth`` (0 = start, 1 = end)."""
    if filler not in FILLERS:
        raise ConfigError(f"filler={filler!r}: allowed: {', '.join(FILLERS)}")
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth={depth}: must be between 0 and 1")
    key = str(random.Random(seed).randint(10000, 99999))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head, needle, tail = encode(INTRO), encode(NEEDLE.format(key=key)), encode(QUESTION)
    room = n_tokens - len(head) - len(needle) - len(tail)
    if room < 0:
        raise ConfigError(f"synthetic_tokens={n_tokens}: too short; at least "
                          f"{n_tokens - room} tokens are needed for the passkey prompt")
    hay = _haystack(encode, room, filler)
    cut = int(len(hay) * depth)
    return Prompt(head + hay[:cut] + needle + hay[cut:] + tail, key)


def _haystack(encode, n_tokens: int, filler: str) -> list[int]:
    unit = encode(FILLER) if filler == "repeat" else encode(_real_text())
    repeats = -(-n_tokens // len(unit)) if unit else 0
    return (unit * repeats)[:n_tokens]


def _real_text() -> str:
    from pydoc_data.topics import topics  # CPython's own docs: ~465K characters of English
    return "\n\n".join(topics[name] for name in sorted(topics))


def read_document(path: Path, *, named: str = "--doc") -> str:
    """A text file's content; an error a user can fix names the file (as ``named``) and the problem."""
    where = f"{named} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a directory; give a text file") from None
    except UnicodeDecodeError as error:       # a PDF, an archive, a file in another encoding: the model would read noise
        raise ConfigError(f"{where}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                          f"{error.start}); give a text file, or convert it (iconv -t UTF-8, pdftotext)") from None
    except OSError as error:                  # no permission, a device that cannot be read, ...
        raise ConfigError(f"{where}: cannot read it ({error.strerror or error})") from None
    if not text.strip():
        raise ConfigError(f"{where}: the file is empty")
    return text


def chat_ids(tokenizer, messages: list[dict[str, str]], *, generation: bool = True) -> list[int]:
    """Token ids of ``messages`` in the model's chat template (``generation``: ready for the
    assistant's turn); for a tokenizer without a template, the contents joined as plain text."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "\n\n".join(m["content"] for m in messages) + ("\n\n" if generation and messages else "")
    return list(tokenizer(text)["input_ids"]) if text else []
