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
    ├── AuthError              missing or wrong credentials (fatal)
    └── EngineError            an engine failed while serving a request
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
