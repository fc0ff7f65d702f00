"""Every error voicebot raises on purpose, in one place.

Each carries a machine-readable ``code``; at the edge a transport turns it into a
wire error event (``{"type": "error", "code": ..., "message": ...}``) and the
session goes on unless ``fatal`` is set.

    VoicebotError
    ├── ConfigError            bad configuration (CLI message, exit 2)
    ├── ModelError             a model cannot be provisioned or loaded
    │   └── BundleError        an offline-bundle package is missing or its hash differs
    ├── ProtocolError          a client sent something we cannot accept (session continues)
    │   ├── BadMessage         malformed JSON / unknown event / bad field
    │   ├── BadAudio           undecodable or wrongly sized audio
    │   └── MessageTooLarge    over server.max_message_bytes
    ├── CapacityError          no session slot / engine queue full (fatal for that session)
    ├── AuthError              missing or wrong credentials, or a browser origin not allowed (fatal)
    └── EngineError            an engine failed while serving a request
        └── LateLoopTimeout    a request to an engine service timed out because our own loop was late

Wire codes a client can act on (the class sets the default; raisers may refine it):

    unauthorized, origin_not_allowed          AuthError: close 1008 / HTTP 401, 403
    capacity_exceeded                          no slot: close 1013 / HTTP 429 / busy TwiML
    not_ready, draining, engine_unavailable    NotReady (server/state.py): close 1013 / HTTP 503
    invalid_event, unknown_event, invalid_value, unsupported_format, invalid_voice
                                               BadMessage: an error event, the session goes on
    invalid_audio, input_rate_exceeded, input_backlog_full
                                               BadAudio / rate gate: the audio is dropped
    message_rate_exceeded                      control messages over server.control_rate: dropped
    message_too_large, payload_too_large, text_too_long
                                               size limits: the message is dropped (HTTP 413)
    server_shutdown (close 1001), engine_failed (close 1011), idle_timeout
                                               why a session was ended by the server
    asr_unavailable, asr_timeout, tts_unavailable, tts_timeout
                                               EngineError of a shared ASR / TTS service (asr-serve,
                                               tts-serve): unreachable, or no answer in time

Between an engine service and its frontends only (never sent to a caller): ``busy`` (the
service is full: the frontend raises CapacityError, as a full engine queue does in-process),
``invalid_request`` (a malformed request), ``dropped`` (an ASR partial with no room).
"""

from __future__ import annotations


class VoicebotError(Exception):
    code: str = "internal_error"
    fatal: bool = False

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class ConfigError(VoicebotError):
    code = "invalid_config"
    fatal = True


class ModelError(VoicebotError):
    code = "model_unavailable"
    fatal = True


class BundleError(ModelError):
    code = "bundle_error"


class ProtocolError(VoicebotError):
    code = "invalid_request_error"


class BadMessage(ProtocolError):
    code = "invalid_event"


class BadAudio(ProtocolError):
    code = "invalid_audio"


class MessageTooLarge(ProtocolError):
    code = "message_too_large"


class CapacityError(VoicebotError):
    code = "capacity_exceeded"
    fatal = True


class AuthError(VoicebotError):
    code = "unauthorized"
    fatal = True


class EngineError(VoicebotError):
    code = "engine_error"


class LateLoopTimeout(EngineError):
    """A request to an engine service (the ASR or TTS service) timed out after this
    process's own event loop ran late for half its wait or more: the call's request failed
    as any timeout does (the code stays the timeout's: ``asr_timeout``, ``tts_timeout``),
    but the service's answer may have sat unread while the loop was stuck, so the engine's
    health does not count it (voicebot/runtime/loop_lag.py)."""
