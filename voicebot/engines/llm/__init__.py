"""The language model: vLLM in this process or a remote tier over HTTP, with priority lanes."""
