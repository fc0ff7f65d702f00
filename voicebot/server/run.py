"""``voicebot serve``: provision models, then run the app under uvicorn (one process, or
the workers of one port), draining on signals."""

from __future__ import annotations

import logging
import socket

from voicebot.config import Config
from voicebot.errors import ConfigError
from voicebot.observe.logs import use_json_logs
from voicebot.provision import bundle_names_for, pull, resolve_model
from voicebot.runtime.process import apply_process_settings
from voicebot.server.http_server import DrainingServer, uvicorn_config
from voicebot.server.state import ServerState
from voicebot.server.workers import check_workers, serve_workers

log = logging.getLogger(__name__)


def _check_port_free(host: str, port: int) -> None:
    """A port already taken is one clear CLI error before the models are pulled or
    loaded (uvicorn's own bind comes after both, and exits 3 with a log line)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"server.host {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror} (another voicebot or another "
                "program has it: stop it, or choose --port)"
            ) from None


def serve(cfg: Config, *, pull_models: bool = True) -> int:
    if cfg.server.log_format == "json":
        use_json_logs()
    check_workers(cfg)
    _check_port_free(cfg.server.host, cfg.server.port)
    # Before anything starts threads or loads an OpenMP runtime: a first start's pull builds
    # the LLM bundle with torch in this process (docs/reliability.md, memory; threads.py).
    apply_process_settings(cfg.server)
    names = bundle_names_for(cfg)
    if names and pull_models:
        # Before binding the port, so a missing package is one clear CLI error.
        pull(names, cfg.models, log=lambda msg: log.info("%s", msg))
    else:
        # --no-pull: a model not built is a CLI error here. The engines resolve their
        # models with the pull on, so they would have built it after the port was bound.
        for name in names:
            resolve_model(f"bundle:{name}", cfg.models, pull=False)
    if cfg.server.workers > 1:
        return serve_workers(cfg)
    from voicebot.server.app import create_app

    state = ServerState(cfg)
    app = create_app(cfg, state=state)
    log.info("listening on http://%s:%d (WebSocket /ws)", cfg.server.host, cfg.server.port)
    config = uvicorn_config(cfg, app, host=cfg.server.host, port=cfg.server.port)
    server = DrainingServer(config, state)
    server.run()
    return 0 if server.started else 1  # not started: the port was taken, or start-up failed
