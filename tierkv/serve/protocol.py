"""The OpenAI-compatible request bodies ``tierkv serve`` accepts, validated, and its error format.

A field the API defines but tierkv does not implement is accepted only at its neutral value
(``n`` 1, penalties 0, no logprobs, no tools, no logit bias, not stored); any other field is an
error. Every error is OpenAI's shape, with the HTTP status it comes with::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierkv.session import Sampling


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    """Unknown fields and values of the wrong type are refused, as OpenAI's API refuses them ("3" is not
    a max_tokens, "true" not a stream), not converted; NaN and infinity are not numbers here."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]      # (developer: newer clients' system)
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)    # (a 64-bit generator's seed)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported (only {})")
        return bias

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("store: completions are not stored here (only false)")
        return store

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (only 0)")
        return value

    @model_validator(mode="after")
    def _streamed_options(self) -> _Generation:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true (an answer sent whole has its usage)")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 stop strings, none empty")
        return stop

    def sampling(self, default_tokens: int, most_tokens: int) -> Sampling:
        tokens = self.max_tokens or default_tokens
        if tokens > most_tokens:
            raise ValueError(f"max_tokens={tokens}: this server generates at most {most_tokens} tokens "
                             "(tierkv serve --max-new-tokens)")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Sampling(max_new_tokens=tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                        stop=stop)


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tokens(self) -> ChatRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tools: function calling is not supported (only an empty list)")
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them; a participant's ``name`` goes with its message,
        for templates that show it (SmolLM2's does not)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                 **({"name": m.name} if m.name else {})} for m in self.messages]


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError(f"one prompt a request is supported, not {len(prompt)}")
            return prompt[0]
        return prompt
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None
