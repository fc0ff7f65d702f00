"""WebRTC in the OpenAI Realtime style, on the same port as everything else.

    POST /v1/realtime/client_secrets   server API key -> short-lived "ek_..." secret
    POST /v1/realtime/calls            SDP offer (application/sdp, or multipart with
                                       sdp + session) -> 201, SDP answer, Location
    POST /v1/realtime                  the same, for the beta flow (?model= ignored)
    POST /v1/realtime/calls/{id}/hangup  end a call from a trusted backend

So OpenAI's browser examples work with only the base URL changed: the page POSTs its
offer with ``Authorization: Bearer <ek_...>``, Opus audio flows both ways on the media
track, and Realtime events (minus audio deltas) travel on the data channel
``oai-events``. Each answered offer becomes one :class:`~voicebot.transports.webrtc_call.Call`
running beside the request; every call registers with the server state so shutdown
closes its peer connection and waits for it.

Errors are OpenAI-shaped JSON: ``{"error": {"type", "code", "message"}}`` with 400,
401, 403 (a browser origin not allowed), 413 (body too large), 415, 429 (no session
slot) or 503 (models still loading, or draining).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from voicebot.errors import AuthError, BadMessage, ProtocolError, VoicebotError
from voicebot.server import edge, forward
from voicebot.server.connection import Connection
from voicebot.server.state import ServerState
from voicebot.transports.webrtc_call import Call, worker_of

log = logging.getLogger(__name__)

_MAX_SDP_BYTES = 64 << 10  # real offers are 2-8 KiB
_MAX_SECRET_BODY = 64 << 10  # a session config: instructions (20k chars max) and a few fields
_DEFAULT_TTL_S = 600  # OpenAI's default client secret lifetime
_MIN_TTL_S, _MAX_TTL_S = 10, 7200
_ANSWER_TIMEOUT_S = 15.0  # ICE gathering is host-only, so answering takes milliseconds
_SHUTDOWN_WAIT_S = 5.0


def error_response(status: int, type_: str, code: str, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": type_, "code": code, "message": message}}, status_code=status
    )


def _refused(conn: Connection, exc: VoicebotError) -> JSONResponse:
    """A refusal, counted once: the HTTP status (edge.http_status) and OpenAI error type."""
    status = conn.refuse_http(exc)
    kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
    return error_response(status, kind, exc.code, str(exc))


class Calls:
    """The live calls of one server."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.live: dict[str, Call] = {}
        # Strong references: a call task is only referenced from here (RUF006).
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, call: Call) -> None:
        task = asyncio.create_task(call.run(), name=f"webrtc-{call.id}")
        self.live[call.id] = call
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self.live.pop(call.id, None)

        task.add_done_callback(done)

    async def aclose(self) -> None:
        """Server shutdown: end every call and wait for its peer connection to close."""
        for call in list(self.live.values()):
            call.end("server shutdown")
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_SHUTDOWN_WAIT_S)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        for pc in list(self.state.peer_connections):  # belt and braces: nothing may survive
            with contextlib.suppress(Exception):
                await pc.close()
            self.state.peer_connections.discard(pc)


async def _read_offer(request: Request) -> tuple[str, dict[str, Any]]:
    """The SDP offer and the optional Realtime session config of a calls request."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in ("multipart/form-data", "application/sdp", "text/plain", ""):
        raise BadMessage(
            f"send the offer as application/sdp, not {ctype}", code="unsupported_media_type"
        )
    # The whole body is bounded before anything parses it (multipart adds the session).
    request = await edge.read_body(request, 2 * _MAX_SDP_BYTES)
    if ctype == "multipart/form-data":
        try:
            async with request.form(max_files=0, max_fields=8, max_part_size=_MAX_SDP_BYTES) as form:
                sdp, session = form.get("sdp"), form.get("session")
        # Starlette raises its parser's error as an HTTPException inside an app (answered
        # 400 text/plain), a MultiPartException outside one: either is a bad offer here.
        except MultiPartException as exc:
            raise BadMessage(f"multipart body: {exc.message}", code="invalid_sdp") from None
        except HTTPException as exc:
            raise BadMessage(f"multipart body: {exc.detail}", code="invalid_sdp") from None
        if not isinstance(sdp, str):
            raise BadMessage("multipart body needs an 'sdp' field", code="invalid_sdp")
        config: dict[str, Any] = {}
        if isinstance(session, str) and session.strip():
            config = edge.load_json(session)
            if not isinstance(config, dict):
                raise BadMessage("'session' must be a JSON object")
        return sdp, config
    body = await request.body()
    if len(body) > _MAX_SDP_BYTES:
        raise ProtocolError(f"SDP offer of {len(body)} bytes is too large", code="payload_too_large")
    return body.decode("utf-8", errors="replace"), {}


def routes(state: ServerState) -> list[BaseRoute]:
    calls = Calls(state)
    state.shutdown_hooks.append(calls.aclose)

    async def create_call(request: Request) -> Response:
        conn = Connection(state, "webrtc", request)
        try:
            # Before anything else: a foreign page's text/plain POST needs no CORS
            # preflight, so the origin is the only thing that stops it opening calls.
            conn.check_origin()
            conn.authenticate()
            # Fail fast with a clear status before the body is read or WebRTC work done.
            conn.check_admission()
            sdp, config = await _read_offer(request)
            if not sdp.lstrip().startswith("v=0"):
                raise BadMessage(
                    "the body is not an SDP offer (it must start with 'v=0')", code="invalid_sdp"
                )
            # The session config minted with the caller's secret, if it used one.
            session_config = {**(state.secrets.session(conn.bearer()) or {}), **config}
            # The beta flow (POST /v1/realtime) gets the beta event names, as on OpenAI.
            beta = (
                request.url.path == "/v1/realtime"
                or request.headers.get("openai-beta", "").lower() == "realtime=v1"
            )
            call = Call(conn, sdp, session_config, beta=beta)
            calls.start(call)
            try:
                answer = await asyncio.wait_for(asyncio.shield(call.answer), _ANSWER_TIMEOUT_S)
            except TimeoutError:
                call.end("answer timed out")
                raise VoicebotError("could not answer the offer in time") from None
        except VoicebotError as exc:
            return _refused(conn, exc)
        return Response(
            answer,
            status_code=201,
            media_type="application/sdp",
            headers={"Location": f"/v1/realtime/calls/{call.id}"},
        )

    async def hangup(request: Request) -> Response:
        conn = Connection(state, "webrtc", request)
        try:
            conn.check_origin()
            conn.authenticate_api_key()
        except AuthError as exc:
            return _refused(conn, exc)
        call_id = request.path_params["call_id"]
        call = calls.live.get(call_id)
        if call is None:
            owner = forward.owner_of(state.siblings, request, worker_of(call_id))
            answer = None if owner is None else await forward.forward(state.siblings, owner, request)
            if answer is not None:
                return answer
            return error_response(404, "invalid_request_error", "call_not_found", "no such call")
        call.end("hangup")
        return Response(status_code=200)

    async def client_secret(request: Request) -> Response:
        conn = Connection(state, "webrtc", request)
        try:
            conn.check_origin()
            conn.authenticate_api_key()
            body = await _json_body(await edge.read_body(request, _MAX_SECRET_BODY))
            ttl = _ttl(body.get("expires_after"))
            session = body.get("session") or {}
            if not isinstance(session, dict):
                raise BadMessage("'session' must be an object")
            value, expires_at = state.mint_secret(ttl, session)
        except VoicebotError as exc:
            return _refused(conn, exc)
        effective = {"type": "realtime", "object": "realtime.session", **session}
        return JSONResponse({"value": value, "expires_at": int(expires_at), "session": effective})

    return [
        Route("/v1/realtime/client_secrets", client_secret, methods=["POST"]),
        Route("/v1/realtime/calls", create_call, methods=["POST"]),
        Route("/v1/realtime/calls/{call_id}/hangup", hangup, methods=["POST"]),
        # Beta flow; the WebSocket route at the same path only matches websocket scopes.
        Route("/v1/realtime", create_call, methods=["POST"]),
    ]


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    body = edge.load_json(raw)
    if not isinstance(body, dict):
        raise BadMessage("the body must be a JSON object")
    return body


def _ttl(expires_after: object) -> float:
    """OpenAI's ``expires_after: {"anchor": "created_at", "seconds": N}``, bounded."""
    if expires_after is None:
        return _DEFAULT_TTL_S
    seconds = expires_after.get("seconds") if isinstance(expires_after, dict) else None
    if not isinstance(seconds, int | float) or not _MIN_TTL_S <= seconds <= _MAX_TTL_S:
        raise BadMessage(
            f"expires_after.seconds must be {_MIN_TTL_S}..{_MAX_TTL_S}", code="invalid_value"
        )
    return float(seconds)
