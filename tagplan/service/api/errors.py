"""Error answers: every one is JSON `{"detail": "..."}`; bad input is always a 4xx, never a traceback.

A database that does not answer (down, restarting, locked past its timeout) is a 503 with
`Retry-After`, not a 500: nothing was done, and the same request may be sent again. Messages
quote at most `requests.MAX_SHOWN` characters of any value, key or number and `MAX_DETAIL_CHARS`
in all. A JSON body too deep (or with too long a number) for the parser is a 422 that says so,
not FastAPI's bare 400 "There was an error parsing the body".
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy import exc as db_errors
from starlette.exceptions import HTTPException

from tagplan.errors import SpecError
from tagplan.service.requests import MAX_NESTING, MAX_SHOWN, LimitError, clipped, describe, shown

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
MAX_DETAIL_CHARS = 1000
MAX_MESSAGE_CHARS = 300  # one validation error's message in the `errors` list
MAX_LISTED = 20  # validation errors listed at most, as many as fit in about MAX_DETAIL_CHARS (the detail: 5)
_LONG_NUMBER = re.compile(rf"\d{{{MAX_SHOWN + 1},}}")
UNAVAILABLE = (db_errors.OperationalError, db_errors.InterfaceError, db_errors.TimeoutError,
               db_errors.DisconnectionError)


def install(app: FastAPI) -> None:
    """Register the handlers on `app`."""
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(LimitError, _over_limit)  # type: ignore[arg-type]
    app.add_exception_handler(SpecError, _bad_spec)  # type: ignore[arg-type]
    for error in UNAVAILABLE:
        app.add_exception_handler(error, _unavailable)
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _bug)


def short(message: str) -> str:
    """`message` as an answer gives it: quoted values and runs of digits longer than `MAX_SHOWN`
    characters cut to that, at most `MAX_DETAIL_CHARS` in all."""
    message = clipped(message)
    message = _LONG_NUMBER.sub(lambda m: f"{m.group(0)[:MAX_SHOWN]}... ({len(m.group(0))} digits)", message)
    return message if len(message) <= MAX_DETAIL_CHARS else message[:MAX_DETAIL_CHARS - 3] + "..."


def _part(part: Any) -> str | int:
    """One step of an error's location: a list index as is, a key cut like a value."""
    if isinstance(part, int):
        return part
    text = str(part)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _bounded(error: Mapping[str, Any]) -> dict[str, Any]:
    """A pydantic error whose location (any key of the body, of any length) and message are cut short."""
    return {**error, "loc": tuple(_part(p) for p in error.get("loc", ())),
            "msg": short(str(error.get("msg", "")))[:MAX_MESSAGE_CHARS]}


async def _invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
    everything = err.errors()
    errors = [_bounded(e) for e in everything[:MAX_LISTED]]
    listed: list[dict[str, Any]] = []
    size = 0
    for e in errors:  # as many as fit in about MAX_DETAIL_CHARS, at least one
        item = {"loc": [str(p) for p in e["loc"]], "msg": e["msg"], "got": shown(e.get("input"))}
        size += len(json.dumps(item))
        if listed and size > MAX_DETAIL_CHARS:
            break
        listed.append(item)
    more = f"; and {len(everything) - 5} more" if len(everything) > 5 else ""
    detail = short("; ".join(describe(e) for e in errors[:5]) + more)
    return JSONResponse({"detail": detail or "invalid request", "errors": listed}, status_code=422)


async def _over_limit(_: Request, err: LimitError) -> JSONResponse:
    return JSONResponse({"detail": short(str(err))}, status_code=int(getattr(err, "status", 422)))


async def _bad_spec(_: Request, err: SpecError) -> JSONResponse:
    return JSONResponse({"detail": short(str(err))}, status_code=422)


async def _http_error(request: Request, err: HTTPException) -> Response:
    unreadable = _unreadable_body(err)
    if unreadable is None:
        return await http_exception_handler(request, err)
    return JSONResponse({"detail": unreadable}, status_code=422)


def _unreadable_body(err: HTTPException) -> str | None:
    """Why a JSON body could not be parsed, where FastAPI answers only 400 "There was an error parsing
    the body" (it raises that from the parser's own error); None for every other HTTPException."""
    cause = err.__cause__
    if err.status_code != 400 or not isinstance(cause, RecursionError | ValueError):
        return None
    if isinstance(cause, RecursionError):
        return (f"body: not readable JSON: nested too deeply for the parser; a request nests at most {MAX_NESTING} "
                "levels inside a field (an inline graph or cluster file)")
    if isinstance(cause, UnicodeDecodeError):
        return f"body: not readable JSON: not UTF-8 text (byte {cause.start})"
    return f"body: not readable JSON: {short(str(cause).split(';')[0])}"


async def _unavailable(request: Request, err: Exception) -> JSONResponse:
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, type(err).__name__)
    return JSONResponse({"detail": f"the service's database is not answering ({type(err).__name__}); nothing "
                                   f"was done: retry in {RETRY_AFTER_S} s"},
                        status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


async def _bug(request: Request, err: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=err)
    return JSONResponse({"detail": "internal error (a bug in the service; the server log has the traceback)"},
                        status_code=500)
