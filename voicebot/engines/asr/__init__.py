"""Speech recognition: the shared streaming engine, its per-call stream and its backends."""
