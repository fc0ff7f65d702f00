"""``python -m voicebot.provision models pull|list|path`` (the same as ``voicebot models``)."""

from __future__ import annotations

import argparse
import sys

from voicebot.provision.cli import add_models_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voicebot")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
