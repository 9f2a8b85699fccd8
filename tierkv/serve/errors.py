"""What the server answers a failure with, in OpenAI's error format: `ApiError` (a status, a body,
headers) and the error a request's work raised as one (`as_api_error`)."""
from __future__ import annotations

from tierkv.errors import (BudgetExceeded, ConfigError, DiskFullError, StoreReadError, StoreUnusable,
                           StoreWriteError, TierKVError)
from tierkv.serve.protocol import error_body
from tierkv.serve.worker import TiersTooSmall
from tierkv.session.inputs import PromptTooLong


class ApiError(Exception):
    """An HTTP error response: ``status``, the OpenAI error ``body``, and ``headers`` (``Retry-After``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind=kind, param=param, code=code)
        self.headers = headers


def as_api_error(error: BaseException) -> ApiError:
    """What a request's client is told of an error its work raised: its own mistakes in words (4xx), the
    server's trouble without the store's paths or the operator's advice (the worker logs those)."""
    if isinstance(error, PromptTooLong):
        return ApiError(400, str(error), param="messages", code="context_length_exceeded")
    if isinstance(error, StoreUnusable):        # (its path and the operator's advice: in the log)
        return ApiError(500, "the server's KV store cannot be used; its log has the details", kind="server_error")
    if isinstance(error, ConfigError):
        return ApiError(400, str(error))
    if isinstance(error, TiersTooSmall):        # the tiers' words (and paths) are the operator's: in the log
        return ApiError(400, "the prompt and its answer need more KV than this server's tiers hold; send a shorter "
                        "prompt or a smaller max_tokens", code="context_length_exceeded")
    if isinstance(error, BudgetExceeded):       # a store shared with other processes, full for now
        return ApiError(503, "the server's KV tiers have no room for now; try again later", kind="server_error",
                        code="server_busy", headers={"Retry-After": "5"})
    if isinstance(error, DiskFullError):
        return ApiError(507, "the server's KV store is out of disk space; its log has the details", kind="server_error")
    if isinstance(error, (StoreReadError, StoreWriteError)):      # its file's path is the operator's: in the log
        return ApiError(500, "the server's KV store failed to read or write; its log has the details",
                        kind="server_error")
    if isinstance(error, TierKVError):
        return ApiError(500, str(error), kind="server_error")
    return ApiError(500, "internal error; the server's log has the details", kind="server_error")
