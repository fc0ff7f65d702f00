"""``voicebot serve``: provision models, then run the app under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from voicebot.config import Config
from voicebot.provision import bundle_names_for, pull

log = logging.getLogger(__name__)


def serve(cfg: Config, *, pull_models: bool = True) -> int:
    names = bundle_names_for(cfg)
    if names and pull_models:
        # Before binding the port, so a missing package is one clear CLI error.
        pull(names, cfg.models, log=lambda msg: log.info("%s", msg))
    from voicebot.server.app import create_app

    app = create_app(cfg)
    log.info("listening on http://%s:%d (WebSocket /ws)", cfg.server.host, cfg.server.port)
    uvicorn.run(
        app,
        host=cfg.server.host,
        port=cfg.server.port,
        ws="websockets-sansio",
        # Up to 4x the limit reaches our handler, which answers with an error event and
        # goes on; beyond that the connection is closed (1009) before it is buffered.
        ws_max_size=4 * cfg.server.max_message_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0
