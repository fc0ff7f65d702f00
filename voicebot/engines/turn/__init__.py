"""Voice activity (Silero VAD) and end of turn (Smart Turn)."""
