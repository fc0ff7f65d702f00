"""What the workers of one port share (voicebot/server/siblings.py, client_secrets.py,
forward.py, metrics.py in multiprocess mode), each with real processes where the point
is another process: spawned workers that count, mint and export metrics."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from voicebot.errors import CapacityError
from voicebot.server import forward
from voicebot.server.client_secrets import MAX_SECRETS, ClientSecrets
from voicebot.server.siblings import Siblings


# ------------------------------------------------------------------ admission counts
def _open_sessions(siblings: Siblings, client: str, n: int, done: multiprocessing.synchronize.Event) -> None:
    for _ in range(n):
        with siblings.admitting():
            siblings.opened(client)
    siblings.set_status("ok", pid=os.getpid())
    done.set()
    time.sleep(30)  # held open until the parent stops it


def test_every_worker_sees_the_whole_servers_counts() -> None:
    siblings = Siblings.create(3, None)
    ctx = multiprocessing.get_context("spawn")
    done = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=_open_sessions, args=(siblings.worker(w), "10.0.0.7", w + 2, done[w]))
             for w in range(2)]
    for p in procs:
        p.start()
    try:
        for event in done:
            assert event.wait(60)
        me = siblings.worker(2)
        assert me.sessions_total() == 2 + 3  # what the other two processes opened
        assert me.client_sessions("10.0.0.7") == 5
        assert me.client_sessions("10.0.0.8") == 0
        rows = me.workers()
        assert [r["active_sessions"] for r in rows] == [2, 3, 0]
        assert [r["status"] for r in rows] == ["ok", "ok", "starting"]
        assert me.pids() == {0: procs[0].pid, 1: procs[1].pid}
        me.opened("10.0.0.8")
        assert me.sessions_total() == 6 and me.client_sessions("10.0.0.8") == 1
        me.closed("10.0.0.8")
        # A worker that died: the parent zeroes its row; its calls are gone with it.
        procs[1].kill()
        procs[1].join()
        siblings.reset(1, "stopped")
        assert me.sessions_total() == 2 and me.client_sessions("10.0.0.7") == 2
        assert me.workers()[1] == {"worker": 1, "pid": None, "status": "stopped", "active_sessions": 0}
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_a_server_of_one_process_counts_alone() -> None:
    alone = Siblings.alone()
    assert (alone.index, alone.count, alone.runtime_dir) == (0, 1, None)
    with alone.admitting():
        alone.opened("a")
    assert alone.sessions_total() == 1 and alone.client_sessions("a") == 1
    alone.set_connections(3)  # a call's, a handshake's, a request's
    assert alone.load(0) == 3
    alone.set_connections(0)
    assert alone.load(0) == 1  # a WebRTC call holds no connection: its session counts
    alone.closed("a")
    assert alone.sessions_total() == 0 and alone.client_sessions("a") == 0
    with pytest.raises(ValueError):
        alone.worker(1)
    with pytest.raises(RuntimeError):
        alone.socket_path(0)


# ------------------------------------------------------------------ client secrets
def _mint(folder: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    queue.put(ClientSecrets(Path(folder)).mint(60, {"instructions": "be brief"}))


@pytest.mark.parametrize("shared", [False, True])
def test_client_secrets_expire_and_are_bounded(tmp_path: Path, shared: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = ClientSecrets(tmp_path / "secrets" if shared else None)
    value, expires = secrets.mint(60, {"voice": "alloy"})
    assert value.startswith("ek_") and abs(expires - time.time() - 60) < 5
    assert secrets.session(value) == {"voice": "alloy"} and secrets.valid(value)
    assert secrets.session(value + "x") is None and not secrets.valid(None) and not secrets.valid("")
    short, _ = secrets.mint(0.05)
    assert secrets.session(short) == {}
    time.sleep(0.1)
    assert not secrets.valid(short) and len(secrets) == 1  # the expired one is gone
    if shared:  # no file names a secret
        assert all(value not in p.name for p in (tmp_path / "secrets").iterdir())
    monkeypatch.setattr("voicebot.server.client_secrets.MAX_SECRETS", 3)
    secrets.mint(60)
    secrets.mint(60)
    with pytest.raises(CapacityError):
        secrets.mint(60)
    assert MAX_SECRETS == 10_000


def test_a_secret_minted_by_one_worker_is_valid_at_another(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_mint, args=(str(tmp_path), queue))
    p.start()
    value, _ = queue.get(timeout=60)
    p.join()
    here = ClientSecrets(tmp_path)
    assert here.session(value) == {"instructions": "be brief"}


# ------------------------------------------------------------------ forwarding
def test_a_call_id_names_its_worker() -> None:
    from voicebot.transports.webrtc_call import call_id, worker_of

    assert worker_of(call_id(3)) == 3 and worker_of("rtc_3_0123456789abcdef0123") == 3
    assert worker_of("rtc_0123456789abcdef0123") is None  # not ours: answered here (404)
    assert worker_of("rtc_x_1") is None and worker_of("rtc__1") is None


async def test_a_request_is_forwarded_to_the_worker_that_holds_it(tmp_path: Path) -> None:
    seen: list[dict[str, str]] = []

    async def hangup(request: Request) -> JSONResponse:
        seen.append(dict(request.headers))
        return JSONResponse({"ended": request.path_params["call_id"]}, status_code=200)

    app = Starlette(routes=[Route("/v1/realtime/calls/{call_id}/hangup", hangup, methods=["POST"])])
    siblings = Siblings.create(2, tmp_path).worker(0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(siblings.socket_path(1)))
    owner = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(owner.serve(sockets=[sock]))
    try:
        while not owner.started:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        scope = {"type": "http", "method": "POST", "path": "/v1/realtime/calls/rtc_1_ab/hangup",
                 "headers": [(b"authorization", b"Bearer sk-1"), (b"origin", b"http://x"), (b"cookie", b"c")],
                 "query_string": b""}

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        request = Request(scope, receive)
        assert forward.owner_of(siblings, request, 1) == 1
        assert forward.owner_of(siblings, request, 0) is None  # ours
        assert forward.owner_of(siblings, request, 7) is None  # no such worker
        assert forward.owner_of(siblings, request, None) is None
        answer = await forward.forward(siblings, 1, request)
        assert answer is not None and answer.status_code == 200 and b"rtc_1_ab" in answer.body
        headers = seen[0]
        assert headers["authorization"] == "Bearer sk-1" and headers["origin"] == "http://x"
        assert "cookie" not in headers and headers[forward.FORWARDED] == "0"
        # A forwarded request is answered where it arrives, never forwarded again.
        again = Request({**scope, "headers": [(forward.FORWARDED.encode(), b"0")]}, receive)
        assert forward.owner_of(siblings, again, 1) is None
    finally:
        owner.should_exit = True
        await serving
    # The owner is gone (it died, and its calls with it): nothing to forward to.
    assert await forward.forward(siblings, 1, request) is None


# ------------------------------------------------------------------ metrics
_EXPORT = """
import os, sys, time
from voicebot.metrics import Metrics
m = Metrics()
assert m.shared
m.active_sessions.labels("native").set(int(sys.argv[1]))
m.sessions.labels("native").inc(int(sys.argv[1]))
m.engine_up.labels("llm").set(int(sys.argv[2]))
m.voice_to_voice.observe(0.5)
print("ready", flush=True)
time.sleep(60)
"""


def test_any_workers_metrics_are_every_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two worker processes export; a third renders what both did, as a scrape sees it."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _EXPORT, str(n), str(up)], env=env, stdout=subprocess.PIPE,
                              text=True) for n, up in ((2, 1), (3, 0))]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        render = subprocess.run(
            [sys.executable, "-c", "import sys; from voicebot.metrics import Metrics; "
             f"sys.stdout.write(Metrics().render(lambda: {{0: {procs[0].pid}, 1: {procs[1].pid}}}).decode())"],
            env=env, capture_output=True, text=True, check=True).stdout
    finally:
        for p in procs:
            p.kill()
            p.wait()

    def value(pattern: str) -> float:
        found = re.search(rf"^{pattern} (\S+)$", render, re.M)
        assert found, (pattern, render)
        return float(found.group(1))

    assert value(r'voicebot_active_sessions\{transport="native"\}') == 5  # livesum
    assert value(r'voicebot_sessions_total\{transport="native"\}') == 5
    assert value(r'voicebot_engine_up\{engine="llm"\}') == 0  # livemin: one worker sees it down
    assert value(r"voicebot_voice_to_voice_seconds_count") == 2
    for worker in (0, 1):  # each worker's own process figures, read from /proc at the scrape
        assert value(rf'process_resident_memory_bytes\{{worker="{worker}"\}}') > 1e6
    assert not re.search(r"^process_resident_memory_bytes ", render, re.M)  # none unlabelled (the scraper's own)


def test_workers_need_a_remote_llm(capsys: pytest.CaptureFixture[str]) -> None:
    from voicebot.cli import main
    from voicebot.config import load_config
    from voicebot.errors import ConfigError
    from voicebot.server.workers import check_workers

    with pytest.raises(ConfigError, match="llm.backend: remote"):
        check_workers(load_config("configs/default.yaml", ["server.workers=2"]))
    check_workers(load_config("configs/default.yaml", ["server.workers=2", "llm.backend=remote"]))
    check_workers(load_config("configs/default.yaml"))  # one worker: anything goes
    assert main(["serve", "--config", "configs/default.yaml", "--workers", "2", "--no-pull"]) == 2
    assert "needs llm.backend: remote" in capsys.readouterr().err


# ------------------------------------------------------------------ the shared socket
class _Served(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(b"hi")
        transport.close()


async def test_a_worker_above_the_least_loaded_steps_aside_then_serves_anyway() -> None:
    """A connection goes to the least loaded serving worker; one more loaded than that
    leaves it in the queue for a while, and takes it itself when no sibling does."""
    from voicebot.server.balance import _MAX_WAIT_S, SharedListener

    siblings = Siblings.create(2, None)
    me, other = siblings.worker(0), siblings.worker(1)
    me.set_status("ok")
    other.set_status("loading")  # a sibling that does not serve yet is no one to wait for
    for _ in range(3):
        me.opened(None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    listener = SharedListener(sock, me, _Served)
    listener.start()
    try:
        async def connect() -> bytes:
            reader, writer = await asyncio.open_connection(*sock.getsockname())
            data = await reader.read()
            writer.close()
            return data

        assert await connect() == b"hi" and listener.stepped_aside == 0
        other.set_status("ok")  # now a sibling with no load serves: this one steps aside...
        t0 = time.monotonic()
        assert await connect() == b"hi"  # ...and, the sibling never taking it, serves it itself
        assert listener.stepped_aside >= 1 and listener.accepted == 2
        assert time.monotonic() - t0 >= _MAX_WAIT_S * 0.9
        for _ in range(5):
            other.opened(None)  # the sibling is the busier one now: no stepping aside
        before = listener.stepped_aside
        assert await connect() == b"hi" and listener.stepped_aside == before
    finally:
        listener.close()
        sock.close()
