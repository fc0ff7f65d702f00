"""The shared ASR and TTS services (``voicebot asr-serve`` / ``tts-serve``), their wire and serving helpers."""
