"""OpenAI-style errors: the exception the API raises, how engine and input errors map to HTTP
statuses, and the ``{"error": {...}}`` bodies (request validation failures included)::

    400 bad parameters / prompt longer than the context   401 missing or wrong API key
    404 unknown model or path                             503 overloaded (``max_waiting``) or engine down
    500 a failed engine step
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from lightinfer.engine.async_engine import EngineDeadError, EngineOverloadedError
from lightinfer.entrypoints import protocol as P


class OpenAIError(Exception):
    """An error to send as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        # A message may echo what the client sent; a lone surrogate in it (valid JSON, not Unicode) would make
        # the response itself fail to encode, a 500 instead of this error: such characters are escaped.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.body = status, P.ErrorResponse(error=P.ErrorInfo(
            message=message, type=type_, param=param, code=code))


def error_response(err: OpenAIError) -> JSONResponse:
    """The JSON response of ``err``."""
    return JSONResponse(err.body.model_dump(), status_code=err.status)


def as_openai_error(exc: Exception) -> OpenAIError:
    """Map exceptions to statuses: ValueError 400 (with the field and code an
    :class:`lightinfer.inputs.InputError` names), overloaded/dead 503, anything else 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(503, str(exc), "server_overloaded", code="overloaded")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"engine unavailable: {exc}", "server_error", code="engine_dead")
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


# pydantic names the member of a union a value failed in its location ("input.str", "input.list[any]"): not a field
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list|dict|none|any|[a-z-]+\[.*\])$")


def field_path(loc: Any) -> str:
    """A validation error's location as the request's field path (``messages.0.content``): ``body`` and pydantic's
    union-member tags left out."""
    return ".".join(str(x) for x in loc or () if x != "body" and not _UNION_MEMBER.match(str(x)))


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """A 400 for a body FastAPI could not read into the request model, naming the field: a body that is
    not JSON, not an object, missing, with fields the endpoint does not know (``Unrecognized request
    argument(s) supplied: <names>``, as OpenAI says), or with a bad field (the first five are listed)."""
    unknown = [field_path(e.get("loc")) for e in exc.errors() if e.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's answer, word for word, to a field it does not know (a typo is not silently dropped)
        s = "s" if len(unknown) > 1 else ""
        return error_response(OpenAIError(400, f"Unrecognized request argument{s} supplied: {', '.join(unknown)}",
                                          param=unknown[0]))
    first = exc.errors()[0] if exc.errors() else {}
    loc = field_path(first.get("loc"))
    raw = first.get("input")
    if isinstance(raw, (bytes, str)) and not loc:  # no JSON Content-Type: FastAPI left the body unparsed
        try:
            json.loads(raw)
        except ValueError as e:
            first = {"type": "json_invalid", "ctx": {"error": str(e)}}
        else:
            return error_response(OpenAIError(400, "send the JSON body with Content-Type: application/json"))
    if first.get("type") == "json_invalid":  # the body itself, not one of its fields
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return error_response(OpenAIError(400, f"the request body is not valid JSON ({detail}); send a JSON "
                                               "object with Content-Type: application/json"))
    if not loc:  # valid JSON, but not an object (a list, a number), or no body at all
        if raw is None:
            return error_response(OpenAIError(400, "the request has no body; send a JSON object with "
                                                   "Content-Type: application/json"))
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(raw),
                                                                                                type(raw).__name__)
        return error_response(OpenAIError(400, f"the request body must be a JSON object, got a JSON {kind}"))
    parts = dict.fromkeys(f"{field_path(e.get('loc'))}: {str(e.get('msg', '')).removeprefix('Value error, ')}"
                          for e in exc.errors()[:5])  # pydantic's prefix to our checks dropped; repeats once
    msg = "; ".join(parts)
    return error_response(OpenAIError(400, msg or "invalid request", param=loc or None))
