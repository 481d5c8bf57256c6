"""Error answers: every one is JSON `{"detail": "..."}`; bad input is always a 4xx, never a traceback.

A database that does not answer (down, restarting, locked past its timeout) is a 503 with
`Retry-After`, not a 500: nothing was done, and the same request may be sent again. Messages
quote at most `requests.MAX_SHOWN` characters of any value and `MAX_DETAIL_CHARS` in all.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as db_errors

from tagplan.errors import SpecError
from tagplan.service.requests import LimitError, clipped, describe, shown

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
MAX_DETAIL_CHARS = 1000
UNAVAILABLE = (db_errors.OperationalError, db_errors.InterfaceError, db_errors.TimeoutError,
               db_errors.DisconnectionError)


def install(app: FastAPI) -> None:
    """Register the handlers on `app`."""
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(LimitError, _over_limit)  # type: ignore[arg-type]
    app.add_exception_handler(SpecError, _bad_spec)  # type: ignore[arg-type]
    for error in UNAVAILABLE:
        app.add_exception_handler(error, _unavailable)
    app.add_exception_handler(Exception, _bug)


async def _invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
    errors = list(err.errors())
    listed = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "got": shown(e.get("input"))}
              for e in errors[:20]]
    detail = "; ".join(describe(e) for e in errors[:5]) + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "")
    return JSONResponse({"detail": detail or "invalid request", "errors": listed}, status_code=422)


async def _over_limit(_: Request, err: LimitError) -> JSONResponse:
    return JSONResponse({"detail": clipped(str(err))[:MAX_DETAIL_CHARS]}, status_code=int(getattr(err, "status", 422)))


async def _bad_spec(_: Request, err: SpecError) -> JSONResponse:
    return JSONResponse({"detail": clipped(str(err))[:MAX_DETAIL_CHARS]}, status_code=422)


async def _unavailable(request: Request, err: Exception) -> JSONResponse:
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, type(err).__name__)
    return JSONResponse({"detail": f"the service's database is not answering ({type(err).__name__}); nothing "
                                   f"was done: retry in {RETRY_AFTER_S} s"},
                        status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


async def _bug(request: Request, err: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=err)
    return JSONResponse({"detail": "internal error (a bug in the service; the server log has the traceback)"},
                        status_code=500)
