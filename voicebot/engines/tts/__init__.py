"""Text to speech: the engines (Piper, espeak-ng, Kokoro, the shared service) and what they share."""
