"""The error body every endpoint returns: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class RequestError(ValueError):
    """A request the server cannot serve as sent; rendered as an HTTP error with this message."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, kind: str = "BadRequestError",
                 close: bool = False, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        # Close the connection after answering: the rest of the request (an oversized body) is not read.
        self.close = close
        self.headers = headers  # e.g. Retry-After on a 503

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.kind, param=self.param, code=self.status))
