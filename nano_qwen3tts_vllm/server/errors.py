"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, for every failure path."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err_type = "invalid_request_error" if status < 500 else "server_error"  # as OpenAI, 401 and 404 included
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# build_request's ValueError messages name what was wrong; map them to the request field (first match wins).
_PARAMS = [("subtalker_temperature", "subtalker_temperature"), ("subtalker_top_k", "subtalker_top_k"),
           ("subtalker_top_p", "subtalker_top_p"), ("speaker", "voice"), ("language", "language"),
           ("ref_text", "ref_text"), ("reference audio", "ref_audio"), ("ref_audio", "ref_audio"),
           ("voice_clone_prompt", "ref_audio"), ("max_new_tokens", "max_new_tokens"), ("top_k", "top_k"),
           ("top_p", "top_p"), ("repetition_penalty", "repetition_penalty"), ("temperature", "temperature"),
           ("seed", "seed"), ("text", "input")]


def param_for(message: str) -> str | None:
    low = message.lower()
    for needle, param in _PARAMS:
        if re.search(rf"\b{re.escape(needle)}", low):
            return param
    return None


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    message = f"{param}: {msg}" if param else msg
    if first.get("type") == "json_invalid":
        param, message = None, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', msg)})"
    return error_response(400, message, param, first.get("type"))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal server error: {exc!r}", None, "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
