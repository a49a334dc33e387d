"""Errors: those the serving layer raises, pydantic's and starlette's, all answered as
OpenAI-style JSON bodies ({"error": {message, type, param, code}}) by the app's handlers."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

import pydantic
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.exceptions import EngineDeadError

logger = logging.getLogger(__name__)


class OpenAIServingError(Exception):
    """An error with an HTTP status, reported as {"error": {message, type, param, code}}."""

    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    error_type: str = "BadRequestError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequestError(OpenAIServingError):
    pass


class NotFoundError(OpenAIServingError):
    status = HTTPStatus.NOT_FOUND
    error_type = "NotFoundError"


class InternalServerError(OpenAIServingError):
    status = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type = "InternalServerError"


class EngineUnavailableError(OpenAIServingError):
    status = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "ServiceUnavailableError"


# The error type vLLM names for each status it answers with.
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "UnauthorizedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    status = HTTPStatus(status)
    error_type = ERROR_TYPES.get(status, status.phrase.replace(" ", "") + "Error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": int(status)}}


class ErrorResponse(JSONResponse):
    """An error's JSON body. A message may quote what the client sent (a model's name, say),
    and a lone surrogate there ("\\ud800", valid JSON) cannot be written as UTF-8: such a
    body is written with every non-ASCII character escaped, where it failed as a 500."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode("ascii")


def json_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return ErrorResponse(error_body(status, message, param), status_code=status)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _location(error: dict) -> list[str]:
    """An error's place in the body, without pydantic's tags for the branches of a union."""
    return [
        str(part)
        for part in error.get("loc", ())
        if part != "body"
        and not (isinstance(part, str) and ("[" in part or "(" in part or part in _UNION_TAGS))
    ]


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One readable message for pydantic's errors, and the parameter they concern."""
    if not errors:
        return "Invalid request.", None
    # A check of ours (a ValueError in a validator) says more than the type errors of the
    # union branches that did not match.
    errors = [e for e in errors if e.get("type") == "value_error"] or errors
    first = errors[0]
    loc = _location(first)
    param = loc[0] if loc else None
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".strip(), None
    if kind in ("model_attributes_type", "dict_type", "model_type") and not loc:
        return (
            "The request body must be a JSON object, sent with Content-Type: application/json.",
            None,
        )
    if kind == "extra_forbidden":
        return f"Unsupported parameter: '{'.'.join(loc)}'.", param
    if kind == "missing" and not loc:
        return (
            "The request body is empty: send a JSON object, with Content-Type: application/json.",
            None,
        )
    if kind == "missing":
        return f"Missing required parameter: '{'.'.join(loc)}'.", param
    messages = []
    for error in errors[:3]:
        text = str(error.get("msg", ""))
        if error.get("type") == "value_error":
            messages.append(text.removeprefix("Value error, "))
        else:
            where = ".".join(_location(error))
            messages.append(f"{where}: {text}" if where else text)
    return "; ".join(dict.fromkeys(messages)), param


def add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIServingError)
    async def _serving_error(_, exc: OpenAIServingError):
        return json_error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(pydantic.ValidationError)
    async def _validation_error(_, exc: RequestValidationError | pydantic.ValidationError):
        message, param = describe_validation_errors(list(exc.errors()))
        return json_error(HTTPStatus.BAD_REQUEST, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return json_error(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, exc: EngineDeadError):
        return json_error(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine is dead: {exc}")

    @app.exception_handler(Exception)
    async def _internal_error(_, exc: Exception):
        logger.exception("Unhandled error in a request", exc_info=exc)
        return json_error(
            HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {type(exc).__name__}"
        )


def to_error(exc: BaseException) -> OpenAIServingError:
    """Any exception from a request's stream, as the error the client gets."""
    if isinstance(exc, OpenAIServingError):
        return exc
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(f"The engine is dead: {exc}")
    return InternalServerError(f"Internal server error: {type(exc).__name__}: {exc}")
