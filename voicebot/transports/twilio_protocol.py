"""Twilio Media Streams, and Telnyx's near-identical dialect: pure, synchronous parts.

No I/O here: parsing inbound messages, building outbound ones, the mark bookkeeping that says how much of a reply the caller
really heard, keypad (DTMF) entry, per-call settings from ``customParameters`` and
the TwiML for the voice webhook. :mod:`voicebot.transports.twilio` moves data
between these and the session.

Wire format (docs/telephony.md): JSON text frames with an ``event`` field; the audio
and mark codecs the probe shares are in :mod:`voicebot.wire.twilio_media`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit
from xml.sax.saxutils import escape

from pydantic import ValidationError

from voicebot.config import TelephonyConfig
from voicebot.errors import BadAudio, BadMessage
from voicebot.server import edge
from voicebot.session.settings import SessionSettings
from voicebot.wire import g711
from voicebot.wire.twilio_media import RATE, mark_name, parse_mark

Dialect = Literal["twilio", "telnyx"]

_ENCODINGS: dict[str, g711.G711] = {
    "audio/x-mulaw": "audio/pcmu", "pcmu": "audio/pcmu", "mulaw": "audio/pcmu", "ulaw": "audio/pcmu",
    "audio/x-alaw": "audio/pcma", "pcma": "audio/pcma", "alaw": "audio/pcma",
}
_DIGIT = re.compile(r"^[0-9*#A-D]$")


# --------------------------------------------------------------------- inbound
@dataclass(frozen=True)
class Connected:
    pass


@dataclass(frozen=True)
class Start:
    stream_id: str  # Twilio streamSid / Telnyx stream_id: outbound messages name it
    call_id: str  # Twilio callSid / Telnyx call_control_id (for logs)
    encoding: g711.G711
    custom: dict[str, str]  # Twilio customParameters (<Parameter> in the TwiML)
    dialect: Dialect


@dataclass(frozen=True)
class Media:
    payload: bytes  # G.711 bytes, one per sample
    track: str  # "inbound" is the caller


@dataclass(frozen=True)
class DtmfPress:
    digit: str


@dataclass(frozen=True)
class MarkEcho:
    name: str  # a mark we sent, now played (or dropped by a clear)


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Other:
    event: str  # e.g. Telnyx "error": logged, not fatal


Inbound = Connected | Start | Media | DtmfPress | MarkEcho | Stop | Other


def _obj(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise BadMessage(f"'{data.get('event')}' message without a '{key}' object")
    return value


def _params(raw: object) -> dict[str, str]:
    """Twilio sends an object; Telnyx may send a list of {name, value}."""
    if isinstance(raw, list):  # names that are not strings (lists, objects) are dropped
        raw = {p["name"]: p.get("value") for p in raw if isinstance(p, dict) and isinstance(p.get("name"), str)}
    if not isinstance(raw, dict):
        return {}
    return {str(k): str(v) for k, v in raw.items() if k is not None and v is not None}


def _start(data: dict[str, Any]) -> Start:
    body = _obj(data, "start")
    telnyx = "stream_id" in data or "media_format" in body
    fmt = body.get("media_format" if telnyx else "mediaFormat") or {}
    if not isinstance(fmt, dict):
        raise BadMessage("'start.mediaFormat' must be an object", code="unsupported_format")
    name = str(fmt.get("encoding", "audio/x-mulaw")).lower()
    raw_rate = fmt.get("sample_rate" if telnyx else "sampleRate", RATE)
    # Twilio sends a number; a numeric string is tolerated, anything else is refused
    # (ASCII digits only: '\u277b'.isdigit() is True, yet int() refuses it).
    text_rate = str(raw_rate)
    rate = int(text_rate) if isinstance(raw_rate, int | str) and text_rate.isascii() and text_rate.isdigit() else None
    if name not in _ENCODINGS or rate != RATE:
        raise BadMessage(f"unsupported media format {name[:40]}/{str(raw_rate)[:20]}: use G.711 at 8000 Hz", code="unsupported_format")
    stream = data.get("stream_id") if telnyx else body.get("streamSid") or data.get("streamSid")
    if not isinstance(stream, str) or not stream:
        raise BadMessage("'start' message without a stream id")
    call = body.get("call_control_id" if telnyx else "callSid") or ""
    custom = _params(body.get("custom_parameters" if telnyx else "customParameters"))
    return Start(stream, str(call), _ENCODINGS[name], custom, "telnyx" if telnyx else "twilio")


def parse_message(text: str) -> Inbound:
    """One text frame from Twilio/Telnyx; BadMessage/BadAudio when it makes no sense."""
    data = edge.load_event(text, "event")  # bounded depth: never a RecursionError
    event = data["event"]
    if event == "media":
        media = _obj(data, "media")
        try:
            payload = base64.b64decode(media.get("payload") or "", validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise BadAudio("media payload is not base64") from None
        return Media(payload, str(media.get("track", "inbound")))
    if event == "start":
        return _start(data)
    if event == "dtmf":
        digit = str(_obj(data, "dtmf").get("digit", ""))
        if not _DIGIT.match(digit):
            raise BadMessage(f"invalid DTMF digit {edge.clip(digit, 16)}")
        return DtmfPress(digit)
    if event == "mark":
        return MarkEcho(str(_obj(data, "mark").get("name", "")))
    if event == "connected":
        return Connected()
    if event == "stop":
        return Stop()
    return Other(event)


# -------------------------------------------------------------------- outbound
class Outbound:
    """Builds what we send: media, mark and clear, addressed to the stream."""

    def __init__(self, stream_id: str, dialect: Dialect) -> None:
        # Telnyx takes no stream id on outbound frames; Twilio requires streamSid.
        self._to = {} if dialect == "telnyx" else {"streamSid": stream_id}

    def media(self, payload: bytes) -> str:
        body = {"payload": base64.b64encode(payload).decode("ascii")}
        return json.dumps({"event": "media", **self._to, "media": body})

    def mark(self, name: str) -> str:
        return json.dumps({"event": "mark", **self._to, "mark": {"name": name}})

    def clear(self) -> str:
        return json.dumps({"event": "clear", **self._to})


class PlayoutMarks:
    """What the caller heard of the reply now playing, from the marks echoed back.

    The transport sends a mark every ``interval_ms`` of reply audio, named after the
    reply and the position it follows. Twilio echoes a mark once the audio before it
    has played, so the highest echoed position is a lower bound (by at most one
    interval) of what the caller heard. After a ``clear`` Twilio also echoes the marks
    it dropped, so echoes of a cut reply are ignored.
    """

    def __init__(self, interval_ms: int = 100) -> None:
        self.interval = interval_ms * RATE // 1000
        self.response_id: str | None = None
        self.sent = 0  # samples of this reply sent
        self.heard_ms = 0
        self._last_mark = 0

    def begin(self, response_id: str) -> str:
        """A new reply starts playing; returns the mark that opens it."""
        self.response_id, self.sent, self.heard_ms, self._last_mark = response_id, 0, 0, 0
        return mark_name(response_id, 0)

    def sent_samples(self, n: int) -> str | None:
        """Audio went out; returns a mark to send after it when one is due."""
        if self.response_id is None:
            return None
        self.sent += n
        if self.sent - self._last_mark < self.interval:
            return None
        self._last_mark = self.sent
        return mark_name(self.response_id, self.sent * 1000 // RATE)

    def end(self) -> str | None:
        """The reply was sent whole: the closing mark (its echo means all was heard)."""
        if self.response_id is None:
            return None
        name = mark_name(self.response_id, self.sent * 1000 // RATE, end=True)
        self.response_id = None
        return name

    def cut(self) -> int:
        """The reply is cut (clear sent): ms heard; later echoes of it are ignored."""
        self.response_id = None
        return self.heard_ms

    def echoed(self, name: str) -> int | None:
        """A mark came back: the new heard position (ms) of the current reply, if it moved."""
        parsed = parse_mark(name)
        if parsed is None or parsed[0] != self.response_id or parsed[1] <= self.heard_ms:
            return None
        self.heard_ms = parsed[1]
        return self.heard_ms


# ------------------------------------------------------------------------ DTMF
@dataclass(frozen=True)
class Hangup:
    pass


@dataclass(frozen=True)
class KeypadEntry:
    digits: str

    @property
    def text(self) -> str:
        """How the assistant is told about it."""
        return "The caller pressed " + " ".join(self.digits) + " on the keypad."


class DtmfCollector:
    """Keypad digits -> hang-up, or entries for the assistant (terminator or pause)."""

    def __init__(self, cfg: TelephonyConfig) -> None:
        self.cfg = cfg
        self._digits = ""
        self._last = 0.0

    def press(self, digit: str, now: float) -> Hangup | KeypadEntry | None:
        if digit == self.cfg.hangup_digit:
            return Hangup()
        if not self.cfg.dtmf_to_llm:
            return None
        if digit == self.cfg.dtmf_terminator:
            return self._take()
        self._digits += digit
        self._last = now
        return self._take() if len(self._digits) >= self.cfg.dtmf_max_digits else None

    def deadline(self) -> float | None:
        """When the pending digits are sent without a terminator (None: nothing waits)."""
        if not self._digits or self.cfg.dtmf_timeout_s <= 0:
            return None
        return self._last + self.cfg.dtmf_timeout_s

    def poll(self, now: float) -> KeypadEntry | None:
        deadline = self.deadline()
        return self._take() if deadline is not None and now >= deadline else None

    def _take(self) -> KeypadEntry | None:
        digits, self._digits = self._digits, ""
        return KeypadEntry(digits) if digits else None


# ------------------------------------------------------------- per-call settings
CALL_FIELDS = ("system_prompt", "voice", "speed", "language", "max_tokens")
# Twilio's call webhook names the caller and the called number From and To; the TwiML
# hands them to the stream as parameters of the same names, for the call's record.
NUMBER_FIELDS = ("From", "To")


def number_params(form: list[tuple[str, str]]) -> dict[str, str]:
    """From and To of Twilio's call webhook, as the stream's parameters."""
    return {k: v[:64] for k, v in form if k in NUMBER_FIELDS and v}


def call_details(start: Start) -> dict[str, str]:
    """What the call's record and trace say of a phone call: the carrier, its ids, and
    the numbers when the TwiML passed them (Telnyx: its own parameters)."""
    custom = {k.lower(): v for k, v in start.custom.items()}
    return {"carrier": start.dialect, "carrier_call_id": start.call_id, "stream_id": start.stream_id,
            "from": custom.get("from", "")[:64], "to": custom.get("to", "")[:64]}


def call_settings(base: SessionSettings, custom: dict[str, str]) -> SessionSettings:
    """Session settings with the call's customParameters applied (other keys ignored).

    The voice is checked by the session against the voices the server loaded."""
    data = base.model_dump()
    data.update({k: v for k, v in custom.items() if k in CALL_FIELDS and v != ""})
    try:
        return SessionSettings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadMessage(f"customParameters.{'.'.join(map(str, err['loc']))}: {err['msg']}", code="invalid_value") from None


# ----------------------------------------------------------------------- TwiML
def stream_url(public_url: str | None, headers: dict[str, str], scheme: str, host: str) -> str:
    """wss://HOST/twilio for the TwiML, behind a proxy (X-Forwarded-*) or not."""
    if public_url:
        return public_url.rstrip("/") + "/twilio"
    proto = headers.get("x-forwarded-proto", scheme).split(",")[0].strip().lower()
    fwd = headers.get("x-forwarded-host", "").split(",")[0].strip()
    return f"{'wss' if proto in ('https', 'wss') else 'ws'}://{fwd or host}/twilio"


def twiml_busy(message: str) -> str:
    """No session slot: say so and hang up (a caller hears why, instead of dead air)."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Response><Say>{escape(message)}</Say><Hangup/></Response>"
    )


# ------------------------------------------------------------ request signatures
def signature(auth_token: str, url: str, params: Iterable[tuple[str, str]] = ()) -> str:
    """Twilio's X-Twilio-Signature: base64(HMAC-SHA1(token, url + each name+value)), the
    POST parameters sorted by name (then value), concatenated without separators."""
    data = url + "".join(k + v for k, v in sorted(params))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def _port_variants(url: str) -> list[str]:
    """The URL as given, without its port and with the scheme's default port: Twilio signs
    the URL exactly as configured, and a proxy may add or drop a default port."""
    parts = urlsplit(url)
    default = {"https": 443, "wss": 443, "http": 80, "ws": 80}.get(parts.scheme)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    bare = urlunsplit(parts._replace(netloc=host))
    with_port = urlunsplit(parts._replace(netloc=f"{host}:{parts.port or default}")) if default else url
    return list(dict.fromkeys([url, bare, with_port]))


def signature_valid(auth_token: str, url: str, params: Iterable[tuple[str, str]], header: str | None) -> bool:
    if not header:
        return False
    items = list(params)
    expected = [signature(auth_token, u, items) for u in _port_variants(url)]
    found = False
    for sig in expected:  # constant time each, no early exit
        found |= hmac.compare_digest(sig.encode(), header.strip().encode())
    return found


def request_url(public_url: str | None, headers: dict[str, str], scheme: str, host: str,
                path: str, query: str) -> str:
    """The URL Twilio requested, as it saw it (behind a proxy: X-Forwarded-*; with
    telephony.public_url: that host), for checking the signature."""
    if public_url:
        parts = urlsplit(public_url)
        base_scheme = {"wss": "https", "ws": "http"}[parts.scheme] if not scheme.startswith("ws") else parts.scheme
        base = f"{base_scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    else:
        proto = headers.get("x-forwarded-proto", "").split(",")[0].strip().lower() or scheme
        if scheme.startswith("ws"):  # the proxy reports http(s) for an upgraded request
            proto = {"https": "wss", "http": "ws"}.get(proto, proto)
        fwd = headers.get("x-forwarded-host", "").split(",")[0].strip()
        base = f"{proto}://{fwd or host}"
    return base + path + (f"?{query}" if query else "")


def _attr(value: str) -> str:
    return '"' + escape(value, {'"': "&quot;", "\n": "&#10;"}) + '"'


def twiml_connect(url: str, params: dict[str, str]) -> str:
    """<Connect><Stream>: a bidirectional stream; the call ends when the socket closes."""
    lines = [f"<Parameter name={_attr(k)} value={_attr(v)}/>" for k, v in params.items()]
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Response><Connect><Stream url={_attr(url)}>{''.join(lines)}</Stream></Connect></Response>"
    )
