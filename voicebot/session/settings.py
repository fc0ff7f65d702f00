"""Per-session settings: what a client may change for its own call."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from voicebot.config import Config, VadConfig


class SessionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    system_prompt: str = Field(..., max_length=20_000, description="Instructions for the assistant.")
    voice: str | None = Field(None, max_length=200, description="TTS voice (engine default if None).")
    speed: float | None = Field(None, ge=0.25, le=4.0, description="Speaking rate multiplier.")
    language: str | None = Field("en", max_length=16, description="Language spoken by the caller.")
    vad: VadConfig = Field(default_factory=VadConfig)
    turn_detection: bool = Field(True, description="Server VAD ends turns; False: the client commits.")
    create_response: bool = Field(True, description="Reply automatically when a turn ends.")
    interrupt_response: bool = Field(True, description="Speech over the reply interrupts it.")
    audio_output: bool = Field(True, description="Speak replies; False: text only (no TTS, no playout).")
    max_tokens: int = Field(160, ge=1, le=4096, description="Longest reply, in tokens.")
    output_sample_rate: int | None = Field(
        None, ge=8000, le=48_000, description="Rate of reply audio events (None: the TTS engine's own rate)."
    )

    @classmethod
    def from_config(cls, cfg: Config) -> SessionSettings:
        return cls(
            system_prompt=cfg.session.system_prompt,
            language=cfg.session.language,
            vad=cfg.vad.model_copy(),
            max_tokens=cfg.llm.max_tokens,
            speed=cfg.tts.speed,
        )
