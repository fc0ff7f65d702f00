"""``voicebot models pull|list|path``: wired into the main CLI by :func:`add_models_parser`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from voicebot.config import Config, load_config
from voicebot.errors import VoicebotError
from voicebot.provision.build import model_store, pull
from voicebot.provision.bundle import load_bundle
from voicebot.provision.resolve import ROLES, bundle_names_for


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``models`` command; the parsed namespace's ``func(args)`` returns the exit code."""
    parser = subparsers.add_parser("models", help="build and inspect the offline model bundle")
    parser.set_defaults(func=lambda _args: _usage(parser))
    sub = parser.add_subparsers(dest="models_command", metavar="{pull,list,path}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="FILE", help="config whose models.* settings apply")
        p.add_argument("--cache-dir", metavar="DIR", help="override models.cache_dir")

    p = sub.add_parser("pull", help="download, assemble and verify bundle entries")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="entries to build (default: those --for loads with this config)")
    p.add_argument("--for", dest="role", choices=ROLES, default="serve",
                   help="the command whose models to build: the frontend (serve, the default), or the "
                        "shared ASR / TTS service that one config file also describes")
    p.add_argument("--all", action="store_true", help="build every entry of models/bundle.toml")
    common(p)
    p.set_defaults(func=models_command)

    p = sub.add_parser("list", help="bundle entries: built?, path, size")
    common(p)
    p.set_defaults(func=models_command)

    p = sub.add_parser("path", help="print the built directory of an entry")
    p.add_argument("name", metavar="NAME")
    common(p)
    p.set_defaults(func=models_command)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 1


def _config(args: argparse.Namespace) -> Config:
    config = load_config(args.config) if args.config else Config()
    if args.cache_dir:
        config.models.cache_dir = args.cache_dir
    return config


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def models_command(args: argparse.Namespace) -> int:
    """Handler for ``voicebot models ...``: errors become one stderr line and exit code 1."""
    try:
        config = _config(args)
        bundle = load_bundle()
        store = model_store(config.models)
        if args.models_command == "pull":
            names = list(bundle.entries) if args.all else args.names or bundle_names_for(config, role=args.role)
            for name, path in pull(names, config.models, bundle=bundle).items():
                print(f"{name}: {path}")
        elif args.models_command == "list":
            for name, entry in bundle.entries.items():
                problem = store.problem(entry, full=False)
                path = store.path(name)
                size = f"{_size(path) / 1e6:8.1f} MB" if problem is None else "       -   "
                state = "built" if problem is None else problem
                print(f"{name:<24} {state:<12} {size}  {path}")
        elif args.models_command == "path":
            entry = bundle.get(args.name)
            if store.problem(entry, full=False) is not None:
                raise VoicebotError(f"{args.name} is not built: run `voicebot models pull {args.name}`")
            print(store.path(entry.name))
        return 0
    except VoicebotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

