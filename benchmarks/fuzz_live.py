"""Live fuzz: 10,000 malformed messages at a running server, then a
normal call on every protocol, then the leak and log checks.

    .venv/bin/python benchmarks/fuzz_live.py --json artifacts/fuzz_live.json

Starts its own server (``benchmarks/serverproc.py``, configs/test.yaml) unless
``--url`` names one already running (then only ``/healthz`` is checked, and the log
only if ``--server-log`` points at it). Loopback addresses only; bounded in count
(``--messages``) and time (``--time-limit-s``).

The messages, spread over every wire the server speaks:

- native ``/ws``: text frames (real event names with mutated fields, JSON of any shape,
  garbage, deep nesting, huge strings) and binary frames (odd lengths, oversized), and
  some as the first message of a connection (a bad ``session.start``);
- Realtime ``/v1/realtime``: the same over the Realtime client events, plus binary;
- Twilio ``/twilio``: the same over the Media Streams events, after a valid start and
  as the start itself;
- WebRTC signalling: ``POST /v1/realtime/calls`` with bad SDP, content types and sizes,
  ``/v1/realtime/client_secrets`` with bad JSON, hang-ups of unknown calls;
- WebRTC data channel ``oai-events`` of a real aiortc call: bad events, binary.

What counts as a defect: a server error on the wire (``internal_error``,
``server_error``, HTTP 5xx, close 1011), a connection dropped without a close frame, a
reply that is not JSON, a traceback in the server's log, a normal call that fails after
the flood, and anything left over (sessions, vLLM requests, tasks, descriptors).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import JSON_EPILOG, write_result  # noqa: E402
from serverproc import SERVER_SET, ServerProcess, http_get, require_loopback  # noqa: E402

from voicebot.probe.client import ProbeConfig, run_level  # noqa: E402
from voicebot.probe.clips import load_clip  # noqa: E402

MAX_MESSAGE = 1 << 20  # the server's default max_message_bytes
PCM_100MS = base64.b64encode(b"\x10\x00" * 2400).decode()
ULAW_20MS = base64.b64encode(b"\xff" * 160).decode()

NATIVE_START = {"type": "session.start", "sample_rate": 16000, "output_sample_rate": 24000,
                "system_prompt": "Be brief.", "vad": {"min_silence_ms": 400}, "max_tokens": 16}
NATIVE = [
    {"type": "input.commit", "event_id": "e1"}, {"type": "input.clear"}, {"type": "response.create"},
    {"type": "response.cancel"}, {"type": "text.input", "text": "hello", "respond": False},
    {"type": "session.update", "system_prompt": "Be brief.", "speed": 1.1, "max_tokens": 16,
     "turn_detection": True, "vad": {"min_silence_ms": 500}},
    {"type": "session.end"},
]
REALTIME = [
    {"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief.",
     "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                         "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}},
               "output": {"voice": "alloy", "format": {"type": "audio/pcmu"}}}, "max_output_tokens": 16}},
    {"type": "session.update", "session": {"input_audio_format": "g711_ulaw", "turn_detection": None,
                                           "modalities": ["text"]}},
    {"type": "input_audio_buffer.append", "audio": PCM_100MS}, {"type": "input_audio_buffer.commit"},
    {"type": "input_audio_buffer.clear"},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "hi"}]}},
    {"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, "audio_end_ms": 10},
    {"type": "conversation.item.delete", "item_id": "item_x"},
    {"type": "response.create"}, {"type": "response.cancel"}, {"type": "output_audio_buffer.clear"},
]
TWILIO_START = {"event": "start", "streamSid": "MZfuzz", "start": {
    "streamSid": "MZfuzz", "callSid": "CAfuzz",
    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
    "customParameters": {"system_prompt": "Be brief."}}}
TWILIO = [
    {"event": "connected", "protocol": "Call", "version": "1.0.0"}, TWILIO_START,
    {"event": "media", "streamSid": "MZfuzz", "media": {"track": "inbound", "payload": ULAW_20MS}},
    {"event": "dtmf", "streamSid": "MZfuzz", "dtmf": {"digit": "5"}},
    {"event": "mark", "streamSid": "MZfuzz", "mark": {"name": "resp_x:100"}},
    {"event": "stop", "streamSid": "MZfuzz"},
]
SERVER_ERRORS = {"internal_error", "server_error"}


class Gen:
    """Seeded malformed-message generator (no hypothesis: this runs against a server)."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def scalar(self) -> Any:
        r = self.r
        return r.choice([None, True, False, 0, -1, 2**63, 1e308, -0.5, "", "x", "é\u2603", "\x00",
                         "audio/pcm", "alloy", "inf", r.random(), r.randint(-10**9, 10**9),
                         "".join(chr(r.randint(1, 0x2FFF)) for _ in range(r.randint(0, 20)))])

    def value(self, depth: int = 0) -> Any:
        roll = self.r.random()
        if depth > 3 or roll < 0.6:
            return self.scalar()
        if roll < 0.8:
            return [self.value(depth + 1) for _ in range(self.r.randint(0, 4))]
        return {self.key(): self.value(depth + 1) for _ in range(self.r.randint(0, 4))}

    def key(self) -> str:
        return self.r.choice(["type", "event", "event_id", "session", "audio", "text", "item", "vad",
                              "media", "payload", "start", "sample_rate", "sampleRate", "mediaFormat",
                              "voice", "speed", "max_tokens", "x", ""])

    def mutate(self, event: dict[str, Any], key: str) -> Any:
        event = copy.deepcopy(event)
        for _ in range(self.r.randint(1, 4)):
            holders = self._holders(event)
            if not holders:  # everything was dropped: start again from the type alone
                event[key] = self.value()
                continue
            holder, k = self.r.choice(holders)
            op = self.r.random()
            if op < 0.4:
                holder[k] = self.value()
            elif op < 0.55:
                del holder[k]
            elif op < 0.7 and isinstance(holder, dict):
                holder[self.key()] = self.value()
            elif op < 0.85:
                holder[k] = [holder[k]]
            else:
                name = str(event.get(key, ""))
                event[key] = self.r.choice([name.upper(), name + ".x", name[:-2], 7, None, [name], {}])
        return event

    def _holders(self, node: Any) -> list[tuple[Any, Any]]:
        out: list[tuple[Any, Any]] = []
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        for k, v in items:
            out.append((node, k))
            out.extend(self._holders(v))
        return out

    def text(self, templates: list[dict[str, Any]], key: str = "type") -> str:
        r, roll = self.r, self.r.random()
        if roll < 0.55:
            return json.dumps(self.mutate(r.choice(templates), key))
        if roll < 0.68:
            raw = bytes(r.getrandbits(8) for _ in range(r.randint(0, 300)))
            return raw.decode(r.choice(["latin-1", "utf-8"]), errors="replace")
        if roll < 0.76:
            return json.dumps(self.value())
        if roll < 0.86:
            depth = r.choice([100, 1_000, 5_000, 100_000])
            opener, closer = r.choice([("[", "]"), ('{"a":', "}")])
            head = json.dumps({key: r.choice(templates)[key]})[:-1]
            return f'{head}, "{self.key() or "x"}": {opener * depth}1{closer * depth}}}'
        if roll < 0.88:
            event = copy.deepcopy(r.choice(templates))
            size = r.choice([64 << 10, 512 << 10, MAX_MESSAGE + 1000])
            event[r.choice(["text", "audio", "padding", "event_id", "instructions"])] = "a" * size
            return json.dumps(event)
        return json.dumps(r.choice(templates))

    def binary(self) -> bytes:
        r = self.r
        size = r.choice([0, 1, 3, 319, 320, 641, 4000, 2 * MAX_MESSAGE]) if r.random() < 0.5 else r.randint(0, 4000)
        return bytes(r.getrandbits(8) for _ in range(min(size, 8192))) * max(1, size // 8192)


class Tally:
    """What came back, per protocol."""

    def __init__(self) -> None:
        self.sent = Counter[str]()
        self.errors = Counter[str]()  # error codes received
        self.closes = Counter[str]()  # close codes of connections that ended
        self.http = Counter[str]()  # status codes
        self.defects = Counter[str]()  # the same defect seen again is counted, not repeated

    def defect(self, what: str) -> None:
        self.defects[what[:200]] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"sent": dict(self.sent), "error_codes": dict(self.errors.most_common(30)),
                "closes": dict(self.closes), "http_status": dict(self.http),
                "defects": [f"{n}x {d}" for d, n in self.defects.most_common(20)]}


# -------------------------------------------------------------- WebSockets
async def ws_flood(name: str, url: str, opener: list[str], count: int, make: Any, tally: Tally,
                   deadline: float, error_of: Any, headers: dict[str, str] | None = None) -> None:
    """One connection after another until ``count`` messages are sent."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    sent = 0
    while sent < count and time.monotonic() < deadline:
        try:
            ws = await connect(url, max_size=None, open_timeout=10, additional_headers=headers)
        except (OSError, InvalidStatus, TimeoutError) as exc:
            tally.defect(f"{name}: cannot connect: {exc!r}")
            await asyncio.sleep(0.5)
            continue

        async def read(ws: Any = ws) -> None:
            with contextlib.suppress(ConnectionClosed):
                async for msg in ws:
                    if isinstance(msg, bytes):
                        continue  # reply audio
                    try:
                        body = json.loads(msg)
                    except ValueError:
                        tally.defect(f"{name}: reply is not JSON: {msg[:200]!r}")
                        continue
                    code = error_of(body)
                    if code is not None:
                        tally.errors[code] += 1
                        if code in SERVER_ERRORS or (isinstance(body.get("error"), dict)
                                                     and body["error"].get("type") == "server_error"):
                            tally.defect(f"{name}: server error for client input: {msg[:300]}")

        reader = asyncio.create_task(read())
        try:
            for text in opener:
                await ws.send(text)
            # A fresh connection lives for a random number of messages.
            for _ in range(random.randint(20, 400)):
                if sent >= count or time.monotonic() > deadline:
                    break
                msg = make()
                await ws.send(msg)
                sent += 1
                tally.sent["binary" if isinstance(msg, bytes) else "text"] += 1
                if sent % 25 == 0:
                    await asyncio.sleep(0.01)  # let replies flow; still ~thousands/min
        except ConnectionClosed:
            pass
        finally:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await asyncio.wait_for(ws.close(), 5)
            await asyncio.wait([reader], timeout=5)
            reader.cancel()
        rcvd = ws.protocol.close_rcvd
        code = "no close frame" if rcvd is None else str(rcvd.code)
        tally.closes[code] += 1
        if rcvd is None or rcvd.code in (1006, 1011):
            tally.defect(f"{name}: connection ended with {code}")


def native_error(body: dict[str, Any]) -> str | None:
    return str(body.get("code")) if body.get("type") == "error" else None


def realtime_error(body: dict[str, Any]) -> str | None:
    if body.get("type") != "error":
        return None
    err = body.get("error")
    return str(err.get("code")) if isinstance(err, dict) else "malformed_error_event"


async def flood_native(base: str, n: int, gen: Gen, tally: Tally, deadline: float) -> None:
    start = json.dumps(NATIVE_START)
    # 10%: a bad session.start, one connection each (the server answers and closes).
    bad_starts = n // 10
    for _ in range(bad_starts):
        await ws_flood("native-start", base + "/ws", [], 1, lambda: gen.text([NATIVE_START]), tally,
                       deadline, native_error)
    await ws_flood("native", base + "/ws", [start], n - bad_starts,
                   lambda: gen.binary() if gen.r.random() < 0.25 else gen.text(NATIVE), tally, deadline,
                   native_error)


async def flood_realtime(base: str, n: int, gen: Gen, tally: Tally, deadline: float) -> None:
    await ws_flood("realtime", base + "/v1/realtime", [], n,
                   lambda: gen.binary()[:64] if gen.r.random() < 0.03 else gen.text(REALTIME), tally,
                   deadline, realtime_error)


async def flood_twilio(base: str, n: int, gen: Gen, tally: Tally, deadline: float) -> None:
    bad_starts = n // 10
    for _ in range(bad_starts):
        await ws_flood("twilio-start", base + "/twilio", [json.dumps(TWILIO[0])], 1,
                       lambda: gen.text([TWILIO_START], key="event"), tally, deadline, lambda _: None)
    await ws_flood("twilio", base + "/twilio", [json.dumps(TWILIO[0]), json.dumps(TWILIO_START)],
                   n - bad_starts, lambda: gen.text(TWILIO, key="event"), tally, deadline, lambda _: None)


# ------------------------------------------------------------ WebRTC HTTP
async def flood_signalling(http: str, n: int, gen: Gen, tally: Tally, deadline: float) -> None:
    import httpx

    r = gen.r
    sdp_like = "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
    async with httpx.AsyncClient(base_url=http, timeout=30) as client:
        for _ in range(n):
            if time.monotonic() > deadline:
                break
            kind = r.random()
            try:
                if kind < 0.6:
                    body: bytes | str = r.choice([
                        gen.text(REALTIME), sdp_like + gen.text(REALTIME), "", "v=0", sdp_like * 50,
                        "v=0\r\n" + "a=x\r\n" * r.choice([10, 20_000]), bytes(r.getrandbits(8) for _ in range(300)),
                    ])
                    ctype = r.choice(["application/sdp", "text/plain", "", "application/json",
                                      "multipart/form-data; boundary=x", "application/octet-stream"])
                    resp = await client.post(r.choice(["/v1/realtime/calls", "/v1/realtime"]), content=body,
                                             headers={"content-type": ctype} if ctype else {})
                elif kind < 0.7:
                    files = {"sdp": (None, r.choice(["", sdp_like, gen.text(REALTIME)])),
                             "session": (None, gen.text(REALTIME))}
                    resp = await client.post("/v1/realtime/calls", files=files)
                elif kind < 0.9:
                    resp = await client.post("/v1/realtime/client_secrets", content=r.choice([
                        gen.text(REALTIME), json.dumps({"expires_after": gen.value(), "session": gen.value()}),
                        "{" * 5000,
                    ]), headers={"content-type": "application/json"})
                else:
                    resp = await client.post(f"/v1/realtime/calls/rtc_{r.getrandbits(64):x}/hangup")
            except httpx.HTTPError as exc:
                tally.defect(f"signalling: request failed: {exc!r}")
                continue
            tally.sent["http"] += 1
            tally.http[str(resp.status_code)] += 1
            if resp.status_code >= 500:
                tally.defect(f"signalling: HTTP {resp.status_code}: {resp.text[:300]}")
            elif resp.status_code == 200:
                pass  # a client secret minted from a body that was still acceptable
            elif resp.status_code == 201:
                # A garbage offer that still made a call: hang it up.
                loc = resp.headers.get("location", "")
                if loc:
                    await client.post(loc + "/hangup")
            else:
                try:
                    err = resp.json()["error"]
                    tally.errors[str(err["code"])] += 1
                except (ValueError, KeyError, TypeError):
                    tally.defect(f"signalling: HTTP {resp.status_code} without an error object: {resp.text[:200]}")


# ------------------------------------------------------- WebRTC data channel
async def flood_datachannel(http: str, n: int, gen: Gen, tally: Tally, deadline: float) -> None:
    from voicebot.probe.base import Audio, ClientClosed, ConnectOptions
    from voicebot.probe.webrtc import WebRTCClient

    sent = 0
    while sent < n and time.monotonic() < deadline:
        client = WebRTCClient(ConnectOptions(url=http, timeout_s=15))
        raw: list[str] = []
        client.seen = raw  # type: ignore[assignment]  # every event type the server sent
        try:
            await client.connect()
        except Exception as exc:
            tally.defect(f"datachannel: cannot connect: {exc!r}")
            await client.close()
            await asyncio.sleep(1)
            continue

        async def drain(client: WebRTCClient = client) -> None:
            with contextlib.suppress(ClientClosed):
                while True:
                    item = await client.receive()
                    if not isinstance(item, Audio) and item.data.get("type") == "error":
                        code = str(item.data.get("code"))
                        tally.errors[code] += 1
                        if code in SERVER_ERRORS:
                            tally.defect(f"datachannel: server error: {item.data}")

        reader = asyncio.create_task(drain())
        try:
            await _datachannel_burst(client, n - sent, gen, tally, deadline)
        finally:
            sent = tally.sent["datachannel"]
            tally.closes[client._closed or "still open"] += 1
            await asyncio.sleep(0.5)
            reader.cancel()
            await asyncio.wait([reader])
            await client.close()


async def _datachannel_burst(client: Any, left: int, gen: Gen, tally: Tally, deadline: float) -> None:
    for _ in range(min(left, random.randint(50, 300))):
        if time.monotonic() > deadline or client._closed is not None:
            break
        msg = gen.binary()[:256] if gen.r.random() < 0.05 else gen.text(REALTIME)
        if len(msg) > 200_000:
            msg = msg[:200_000]  # SCTP messages this big are refused by aiortc itself
        client._channel.send(msg)
        tally.sent["datachannel"] += 1
        await asyncio.sleep(0.004)


# ----------------------------------------------------------------- checks
async def normal_calls(server_ws: str, server_http: str, clip_path: str, protocols: list[str]) -> dict[str, Any]:
    clip = load_clip(clip_path, 16000)
    out: dict[str, Any] = {}
    for protocol in protocols:
        url = {"native": server_ws + "/ws", "realtime": server_ws + "/v1/realtime",
               "twilio": server_ws + "/twilio", "webrtc": server_http}[protocol]
        cfg = ProbeConfig(url=url, clips=(clip,), turns=1, protocol=protocol, timeout_s=60)
        rec = (await run_level(cfg, 1))[0]
        out[protocol] = {"status": rec.status, "transcript": rec.transcript, "reply": rec.reply_text[:100],
                         "voice_to_voice_ms": rec.voice_to_voice_ms, "errors": rec.errors}
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server: ServerProcess | None = None
    if args.url:
        require_loopback(args.url)
        http = args.url.rstrip("/")
        ws = "ws" + http[4:]
    else:
        server = ServerProcess(config=args.config, overrides=(*SERVER_SET, "server.max_sessions=8", *args.set),
                               log_path=Path(args.server_log))
        await asyncio.to_thread(server.start)
        http, ws = server.http, server.ws
    gen = Gen(args.seed)
    random.seed(args.seed)
    result: dict[str, Any] = {"config": vars(args)}
    try:
        result["before"] = await normal_calls(ws, http, args.audio, args.protocols)
        baseline = await asyncio.to_thread(server.wait_idle) if server else None
        n = args.messages
        share = {"native": 0.3, "realtime": 0.25, "twilio": 0.25, "signalling": 0.05, "datachannel": 0.15}
        tallies = {k: Tally() for k in share}
        deadline = time.monotonic() + args.time_limit_s
        t0 = time.monotonic()
        floods = {"native": flood_native(ws, int(n * share["native"]), gen, tallies["native"], deadline),
                  "realtime": flood_realtime(ws, int(n * share["realtime"]), gen, tallies["realtime"], deadline),
                  "twilio": flood_twilio(ws, int(n * share["twilio"]), gen, tallies["twilio"], deadline),
                  "signalling": flood_signalling(http, int(n * share["signalling"]), gen, tallies["signalling"],
                                                 deadline),
                  "datachannel": flood_datachannel(http, int(n * share["datachannel"]), gen,
                                                   tallies["datachannel"], deadline)}
        outcomes = await asyncio.gather(*floods.values(), return_exceptions=True)
        # A bug of this script is reported as such, not as a server defect.
        result["harness_errors"] = {name: repr(o) for name, o in zip(floods, outcomes, strict=True)
                                    if isinstance(o, BaseException)}
        result["flood_s"] = round(time.monotonic() - t0, 1)
        result["sent"] = sum(sum(t.sent.values()) for t in tallies.values())
        result["protocols"] = {k: t.as_dict() for k, t in tallies.items()}
        if server:
            idle = await asyncio.to_thread(server.wait_idle, 60.0)
        else:
            idle = json.loads(http_get(http + "/healthz")[1])
        result["after_flood_idle"] = idle
        result["after"] = await normal_calls(ws, http, args.audio, args.protocols)
        if server:
            await asyncio.sleep(3)
            final = await asyncio.to_thread(server.wait_idle, 30.0)
            result["baseline"], result["final"] = baseline, final
            result["leaks"] = {
                "sessions": final["sessions"],
                "llm_unfinished": (final["llm_running"] or 0) + (final["llm_background_waiting"] or 0),
                "tasks": final["tasks"] - baseline["tasks"],
                "fds": final["fds"] - baseline["fds"],
                "rss_mb": round(final["tree_rss_mb"] - baseline["tree_rss_mb"], 1),
            }
    finally:
        if server:
            result["server_exit_code"] = await asyncio.to_thread(server.stop)
    if server or args.url:
        log = (server or ServerProcess(log_path=Path(args.server_log))).log_problems()
        if server or log["lines"]:
            result["server_log"] = log
    defects = [d for t in result.get("protocols", {}).values() for d in t["defects"]]
    result["defects"] = defects
    result["pass"] = {
        "no_defect_on_the_wire": not defects,
        "harness_ran_whole": not result.get("harness_errors"),
        # Twilio carries no transcript events: its turn is judged on the reply audio alone.
        "normal_calls_after": all(c["status"] == "ok" and (c["transcript"] or p == "twilio")
                                  for p, c in result.get("after", {}).items()),
        "nothing_leaked": all(v == 0 for k, v in result.get("leaks", {}).items() if k != "rss_mb")
        if "leaks" in result else None,
        "no_traceback": result.get("server_log", {}).get("tracebacks") == 0 if "server_log" in result else None,
    }
    return result


def print_summary(result: dict[str, Any]) -> None:
    print(f"\nsent {result.get('sent')} malformed messages in {result.get('flood_s')} s")
    print(f"{'protocol':<12} {'sent':>6} {'errors':>7} {'defects':>7}  closes / HTTP")
    for name, t in result.get("protocols", {}).items():
        print(f"{name:<12} {sum(t['sent'].values()):>6} {sum(t['error_codes'].values()):>7} {len(t['defects']):>7}  "
              f"{t['closes'] or ''} {t['http_status'] or ''}")
    for when in ("before", "after"):
        for proto, c in result.get(when, {}).items():
            print(f"normal call {when:<6} {proto:<9} {c['status']:<7} v2v={c['voice_to_voice_ms']} ms  "
                  f"transcript={c['transcript'][:50]!r}")
    if "leaks" in result:
        print(f"left over: {result['leaks']}")
    if "server_log" in result:
        log = result["server_log"]
        print(f"server log: {log['tracebacks']} tracebacks, {log['error_lines']} ERROR lines")
    for d in result["defects"][:15]:
        print("DEFECT:", d)
    print("pass: " + ", ".join(f"{k}={v}" for k, v in result["pass"].items()))


def main(argv: list[str] | None = None) -> int:
    shared = Path(__file__).resolve().parent.parent.parent / "shared" / "audio" / "goforward.wav"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--url", help="a running server (http://127.0.0.1:PORT); default: start one")
    p.add_argument("--config", default="configs/test.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="server config override, after " + " ".join(SERVER_SET))
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--time-limit-s", type=float, default=300.0, help="limit of the flood itself")
    p.add_argument("--protocols", type=lambda s: s.split(","), default=["native", "realtime", "twilio", "webrtc"],
                   help="protocols of the normal calls before and after")
    p.add_argument("--audio", default=str(shared), help="clip of the normal calls")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--json", default="artifacts/fuzz_live.json")
    p.add_argument("--server-log", default="artifacts/fuzz-server.log")
    args = p.parse_args(argv)
    if not 1 <= args.messages <= 100_000:
        p.error("--messages must be 1..100000")
    result = asyncio.run(run(args))
    write_result(args.json, "fuzz_live", args, result)
    print_summary(result)
    print(f"JSON: {args.json}")
    return 0 if all(v is not False for v in result["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
