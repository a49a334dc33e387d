"""Errors the serving layer raises; the server turns them into OpenAI-style JSON bodies."""

from __future__ import annotations

from http import HTTPStatus


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
