"""The OpenAI server's refusal of a request: an HTTP status and OpenAI's error body naming the
field (`runtime.openai_protocol` and `runtime.openai_tools` raise it, `runtime.openai_http`
answers it)."""

from __future__ import annotations

__all__ = ["ProtocolError"]


class ProtocolError(ValueError):
    """A request the server refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}
