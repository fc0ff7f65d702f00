"""The ``voicebot`` command: serve, asr-serve, tts-serve, probe, models.

Heavy imports (vLLM, faster-whisper) happen inside the subcommands, so
``voicebot --help`` and ``voicebot models list`` stay fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from voicebot.errors import VoicebotError


def _add_config_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--config", default=default, help="YAML config file (default: %(default)s)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set llm.max_tokens=64 (repeatable)",
    )


def _add_service_parser(sub: argparse._SubParsersAction, name: str, engine: str, port: int) -> None:  # type: ignore[type-arg]
    """``asr-serve`` / ``tts-serve``: the config's one ASR or TTS engine for many frontends."""
    p = sub.add_parser(name, help=f"run the shared {engine} service (one engine for many frontends)")
    _add_config_args(p, "configs/default.yaml")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=port, help="listen port, 0: any free one (default: %(default)s)")
    p.add_argument("--no-pull", action="store_true", help="fail instead of building a missing bundle model")
    p.set_defaults(func=_run_service, service=engine)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicebot", description="Real-time voice agent server.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the server",
        epilog="environment (names set by the config): VOICEBOT_API_KEYS, comma-separated keys clients "
        "send as 'Authorization: Bearer KEY' (server.api_keys_env; needed to listen beyond loopback); "
        "TWILIO_AUTH_TOKEN, to check Twilio's request signatures (telephony.auth_token_env); "
        "VOICEBOT_LLM_API_KEY, the remote LLM tier's key (llm.remote.api_key_env)",
    )
    _add_config_args(serve, "configs/default.yaml")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.add_argument("--workers", type=int, help="processes serving the port (overrides server.workers; "
                       "more than 1 needs llm.backend remote)")
    serve.add_argument("--no-pull", action="store_true", help="fail instead of building missing bundle models")

    _add_service_parser(sub, "asr-serve", "ASR", 8092)
    _add_service_parser(sub, "tts-serve", "TTS", 8093)

    from voicebot.probe.cli import add_probe_parser
    from voicebot.provision.cli import add_models_parser

    add_probe_parser(sub)
    add_models_parser(sub)

    replay = sub.add_parser("replay", help="print the decisions of a call recorded with session.record")
    replay.add_argument("call", help="the call's JSON lines")
    replay.add_argument("--all", action="store_true", help="every action, not only turns, replies and summaries")
    replay.set_defaults(func=_replay)
    return parser


def _replay(args: argparse.Namespace) -> int:
    from voicebot.core.replay import SHOWN, describe, replay

    with open(args.call, encoding="utf-8") as f:
        for now, action in replay(f):
            if args.all or isinstance(action, SHOWN):
                print(f"{now:10.3f}  {describe(action)}")
    return 0


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * min(verbose + 1, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        # vLLM and friends log per request at INFO.
        for noisy in ("vllm", "httpx", "faster_whisper", "uvicorn.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


# Secrets given as --set would sit in `ps` output and shell history for every local user.
_SECRET_KEYS = ("server.api_key", "telephony.auth_token")


def _serve(args: argparse.Namespace) -> int:
    from voicebot.config import load_config
    from voicebot.errors import ConfigError
    from voicebot.server import edge
    from voicebot.server.run import serve

    for item in args.overrides:
        key = item.partition("=")[0].strip()
        if key in _SECRET_KEYS:
            raise ConfigError(
                f"{key} on the command line is visible to every user of this machine (ps, shell "
                "history): put API keys in $VOICEBOT_API_KEYS or server.api_key_file, the Twilio "
                "token in $TWILIO_AUTH_TOKEN, or either in the config file"
            )
    overrides = list(args.overrides)
    if args.host:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    if args.workers is not None:
        overrides.append(f"server.workers={args.workers}")
    cfg = load_config(args.config, overrides)
    edge.load_api_keys(cfg.server)  # an unreadable key file: a CLI error now, not after the model pull
    warning = edge.check_exposure(cfg)  # ConfigError (exit 2) when exposed without a key
    if warning:
        logging.getLogger("voicebot").warning("%s", warning)
    return serve(cfg, pull_models=not args.no_pull)


def _run_service(args: argparse.Namespace) -> int:
    from voicebot.config import load_config

    if args.service == "ASR":
        from voicebot.services.asr_service import run_asr_service as run
    else:
        from voicebot.services.tts_service import run_tts_service as run
    cfg = load_config(args.config, list(args.overrides))
    return run(cfg, args.host, args.port, pull=not args.no_pull)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        if args.command == "serve":
            return _serve(args)
        return int(args.func(args) or 0)
    except VoicebotError as exc:
        print(f"voicebot: error: {exc}", file=sys.stderr)
        return 2 if exc.code == "invalid_config" else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
