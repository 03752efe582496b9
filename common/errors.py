"""Typed request failures shared by the services and the client SDK (no torch)."""
from __future__ import annotations

from common.protocol import ErrorCode

HTTP_STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.REFUSED: 401,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.WORKER_LOST: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.KV_TRANSFER_FAILED: 503,
}


class BatonError(Exception):
    """A request failed; `code` says how, `message` says why."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]


class InvalidRequest(BatonError):
    code = ErrorCode.INVALID_REQUEST


class Rejected(BatonError):
    """Refused for load (overloaded); retry after `retry_after_s`."""

    code = ErrorCode.OVERLOADED


class Unauthorized(BatonError):
    code = ErrorCode.REFUSED


class RequestTimeout(BatonError):
    code = ErrorCode.TIMEOUT


class ServerUnavailable(BatonError):
    code = ErrorCode.UNAVAILABLE


class WorkerLost(BatonError):
    """The worker serving the request died after tokens were already streamed."""

    code = ErrorCode.WORKER_LOST


class KvTransferFailed(BatonError):
    """A disaggregated request's prompt KV could not be moved to its decode worker, and
    `kv_load_failure_policy = fail` ends it rather than recomputing."""

    code = ErrorCode.KV_TRANSFER_FAILED


class InternalError(BatonError):
    code = ErrorCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in (InvalidRequest, Rejected, Unauthorized, RequestTimeout,
                                      ServerUnavailable, WorkerLost, KvTransferFailed, InternalError)}


def error_from_code(code: ErrorCode, message: str, retry_after_s: float = 0.0) -> BatonError:
    return _BY_CODE.get(code, InternalError)(message, retry_after_s)
