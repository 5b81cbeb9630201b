"""Error answers in OpenAI's shape, so clients written for OpenAI (and its
official SDK, which reads ``error.message``) show the gateway's reason as is."""

from __future__ import annotations

import json
import math

from .httpserver import Response


def error_body(message: str, *, code: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, *, code: str, param: str | None = None, headers: dict | None = None) -> Response:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps(error_body(message, code=code, type_=type_, param=param)).encode()
    return Response(status, body, headers)


def sse_error(message: str, *, code: str) -> bytes:
    """The event that ends a stream broken after its first byte (``SSE_DONE``
    follows it). The official client raises ``APIError`` on a data event
    carrying ``error``."""
    return b"data: " + json.dumps(error_body(message, code=code, type_="server_error")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"  # the last event of every OpenAI stream, broken ones included


def bad_request(message: str, *, code: str = "invalid_value", param: str | None = None) -> Response:
    return error_response(400, message, code=code, param=param)


def unauthorized(message: str) -> Response:
    return error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="llmgw"'})


def not_found(message: str, code: str = "model_not_found", param: str | None = "model") -> Response:
    return error_response(404, message, code=code, param=param)


def too_large(limit: int) -> Response:
    return error_response(413, f"the request body is larger than this gateway accepts ({limit} bytes)", code="request_too_large")


def unavailable(message: str, retry_after: float) -> Response:
    return error_response(503, message, code="no_ready_replica", headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


def bad_gateway(message: str) -> Response:
    return error_response(502, message, code="upstream_error")


def gateway_timeout(message: str) -> Response:
    return error_response(504, message, code="upstream_timeout")


def out_of_descriptors() -> Response:
    """EMFILE/ENFILE opening a connection to a replica: the gateway's own shortage, not the replica's."""
    return error_response(503, "gateway out of file descriptors; try again shortly", code="gateway_overloaded", headers={"Retry-After": "1"})


def response_too_large(replica: str, limit: int) -> Response:
    return error_response(
        502,
        f"the answer of replica {replica} is larger than this gateway passes on ({limit} bytes; gateway.max_response_bytes)",
        code="upstream_response_too_large",
    )


_REFUSAL_CODES = {
    400: "malformed_request",
    408: "request_timeout",
    413: "request_too_large",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "headers_too_large",
    500: "internal_error",
    501: "not_implemented",
    503: "gateway_overloaded",
}


def refusal(status: int, message: str) -> Response:
    """The HTTP server's own refusals (httpserver.py), in the same shape as every other error."""
    return error_response(status, message, code=_REFUSAL_CODES.get(status, "http_error"), param=None)
