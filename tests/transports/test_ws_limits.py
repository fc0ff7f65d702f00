"""The WebSocket edge's bounds: a client that stops reading, a frame larger than a message.

A client that stops reading (a frozen tab, a dead mobile link that still ACKs, a bot
that only sends) while the caller is silent sends nothing the call reacts to: no
barge-in, no hang-up, no idle timeout (its microphone frames, or the reply itself, keep
the call busy). Reply audio fills the socket's buffers, then every send waits, and an
asyncio transport's ``close()`` waits for a flush that never comes: the call, its reply
and its socket were held for good. It is disconnected after ``server.send_timeout_s``.

An OpenAI Realtime client may put 15 MiB of audio in one ``input_audio_buffer.append``:
the connection was closed (1009) above 4 MiB; it gets an error event, and the call goes on.

The real app (production uvicorn settings) on a real socket, fake engines (tests/fakes.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time

import uvicorn
from fakes import make_engines
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State
from websockets.uri import parse_uri

from voicebot.config import Config
from voicebot.server.app import create_app
from voicebot.server.http_server import uvicorn_config
from voicebot.server.state import ServerState
from voicebot.session.clock import REAL_CLOCK
from voicebot.session.session import Session

SEND_TIMEOUT_S = 1.0
LONG_REPLY = " ".join(["word"] * 400)  # 40 s of the fake TTS's tone: far more than the buffers hold


def _listener(sndbuf: int) -> socket.socket:
    """A listening socket whose accepted connections get a small kernel send buffer, so
    that reply audio fills it in a second or two, not after megabytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock


async def _stalled_client(port: int) -> socket.socket:
    """Open /ws, start a session and ask for a long reply; then never read again."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    ws = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/ws"))

    async def send(event: dict[str, object] | None = None) -> None:
        if event is not None:
            ws.send_text(json.dumps(event).encode())
        await loop.sock_sendall(sock, b"".join(ws.data_to_send()))

    async def until(done) -> None:  # type: ignore[no-untyped-def]
        while True:
            data = await loop.sock_recv(sock, 65536)
            assert data, "the server closed the connection"
            ws.receive_data(data)
            if any(done(e) for e in ws.events_received()) or (ws.state is State.OPEN and done(None)):
                return

    ws.send_request(ws.connect())
    await send()
    await until(lambda _: True)  # the handshake's response
    assert ws.state is State.OPEN, ws.handshake_exc
    await send({"type": "session.start", "sample_rate": 16000, "output_sample_rate": 24000})
    await until(lambda e: e is not None and b"session.started" in bytes(getattr(e, "data", b"")))
    await send({"type": "text.input", "text": "Tell me a long story.", "respond": True})
    return sock


async def test_a_client_that_stops_reading_is_disconnected_and_its_call_freed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, clock=REAL_CLOCK, reply=LONG_REPLY, word_delay=0.001)
    cfg = engines.cfg.model_copy(deep=True)
    cfg.server.send_timeout_s = SEND_TIMEOUT_S
    engines.cfg = cfg
    state = ServerState(cfg, engines=engines)
    app = create_app(cfg, load=False, state=state)
    server = uvicorn.Server(uvicorn_config(cfg, app, lifespan="off", log_level="warning"))
    listener = _listener(4096)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    client: socket.socket | None = None
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        client = await _stalled_client(listener.getsockname()[1])
        async with asyncio.timeout(10):
            while not state.sessions:
                await asyncio.sleep(0.01)
        call: Session = next(iter(state.sessions.values()))
        t0 = time.monotonic()
        # The reply streams into the buffers, which fill; after send_timeout_s of a
        # send going nowhere the server lets go. Bounded: it used to hold on for good.
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S + 10):
                while state.sessions or server.server_state.connections:
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(
                f"after {time.monotonic() - t0:.0f} s the call is still open ({len(state.sessions)} session(s), "
                f"{len(server.server_state.connections)} connection(s)), its reply "
                f"{'still running' if call.replying else 'over'}: a client that reads nothing holds it for good"
            ) from None
        assert call.closed_reason == "slow_consumer", call.closed_reason
        assert state.metrics.errors.labels("slow_consumer")._value.get() == 1
    finally:
        server.should_exit = True
        await serving
        if client is not None:
            client.close()
        listener.close()


async def test_a_close_that_cannot_flush_is_aborted() -> None:
    # Less than the write buffer's high-water mark is left unsent when the handler
    # returns: no send ever waited, but uvicorn's close() waits for a flush that a peer
    # that reads nothing never allows (as after a keepalive timeout).
    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "websocket":
            return
        await receive()
        await send({"type": "websocket.accept"})
        for _ in range(5):
            await send({"type": "websocket.send", "bytes": b"\0" * 8000})

    cfg = Config.model_validate({"server": {"send_timeout_s": SEND_TIMEOUT_S}})
    server = uvicorn.Server(uvicorn_config(cfg, app, lifespan="off", log_level="warning"))
    listener = _listener(4096)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        client.setblocking(False)
        await loop.sock_connect(client, listener.getsockname())
        ws = ClientProtocol(parse_uri(f"ws://127.0.0.1:{listener.getsockname()[1]}/"))
        ws.send_request(ws.connect())
        await loop.sock_sendall(client, b"".join(ws.data_to_send()))
        async with asyncio.timeout(5):
            while not server.server_state.connections:
                await asyncio.sleep(0.01)
        try:
            async with asyncio.timeout(2 * SEND_TIMEOUT_S + 5):
                while server.server_state.connections:
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError("the socket is still open: its close waits for a flush that never comes") from None
    finally:
        server.should_exit = True
        await serving
        client.close()
        listener.close()


async def test_an_openai_sized_append_gets_an_error_event_and_the_call_goes_on(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, clock=REAL_CLOCK)
    state = ServerState(engines.cfg, engines=engines)
    app = create_app(engines.cfg, load=False, state=state)
    server = uvicorn.Server(uvicorn_config(engines.cfg, app, lifespan="off", log_level="warning"))
    listener = _listener(1 << 20)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"ws://127.0.0.1:{listener.getsockname()[1]}/v1/realtime"
        async with connect(url, max_size=None) as ws:

            async def next_of(*types: str) -> dict[str, object]:
                async with asyncio.timeout(20):
                    while True:
                        event = json.loads(await ws.recv())
                        if event["type"] in types:
                            return event  # type: ignore[no-any-return]

            await next_of("session.created")
            audio = base64.b64encode(bytes(15 << 20)).decode()  # 15 MiB of audio, as base64: 20 MiB
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "event_id": "big", "audio": audio}))
            try:
                error = await next_of("error")
            except ConnectionClosed as exc:
                raise AssertionError(f"the call was dropped: {exc}") from None
            assert error["error"]["code"] == "message_too_large", error  # type: ignore[index]
            assert error["error"]["event_id"] == "big", error  # type: ignore[index]
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
            updated = await next_of("session.updated", "error")
            assert updated["type"] == "session.updated", updated
        assert state.metrics.errors.labels("message_too_large")._value.get() == 1
    finally:
        server.should_exit = True
        await serving
        listener.close()
