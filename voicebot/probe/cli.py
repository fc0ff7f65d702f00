"""``voicebot probe``: argument parsing and the run. Heavy imports wait for the
handler so ``voicebot --help`` stays fast."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# What the server accepts in session.start (voicebot/transports/native.py); repeated
# here so building the parser does not import the server stack.
RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
# Sessions one probe process drives with its timing error still well under 1 ms
# (measured: benchmarks/pipeline_probe_cost.py, docs/gpu-results.md).
SESSIONS_PER_WORKER = 128


def auto_workers(sessions: int, cpus: int | None = None) -> int:
    """Processes for ``sessions`` callers: one per SESSIONS_PER_WORKER, at most one per CPU."""
    import os

    cpus = cpus or os.cpu_count() or 1
    return max(1, min(cpus, -(-sessions // SESSIONS_PER_WORKER)))


def _bounded(kind: type, lo: float, hi: float):  # type: ignore[no-untyped-def]
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text} is outside [{lo:g}, {hi:g}]")
        return value

    return parse


def add_probe_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from voicebot.probe.base import CLIENTS

    p = sub.add_parser(
        "probe",
        help="measure voice-to-voice latency / generate load against a running server",
        description="Play WAV files as caller turns in real time over N concurrent sessions and "
        "measure voice-to-voice latency from the audio (-40 dBFS onsets).",
    )
    p.add_argument(
        "--url",
        default="ws://127.0.0.1:8080/ws",
        help="server WebSocket URL (default: %(default)s)",
    )
    p.add_argument(
        "--protocol",
        choices=sorted(CLIENTS),
        default="native",
        help="wire protocol (default: %(default)s)",
    )
    p.add_argument(
        "--audio",
        nargs="+",
        required=True,
        metavar="PATH",
        help="WAV files, any rate; turns cycle through them",
    )
    p.add_argument(
        "--sessions",
        nargs="+",
        type=_bounded(int, 1, 4096),
        default=[1],
        metavar="N",
        help="concurrent sessions; several values run one level after another (default: 1)",
    )
    p.add_argument(
        "--workers",
        type=_bounded(int, 0, 256),
        default=0,
        help=f"probe processes the sessions are spread over; 0: one per {SESSIONS_PER_WORKER} "
        "sessions, at most one per CPU (default: %(default)s)",
    )
    p.add_argument(
        "--turns",
        type=_bounded(int, 1, 10_000),
        default=3,
        help="turns per session (default: %(default)s)",
    )
    p.add_argument(
        "--stagger-ms",
        type=_bounded(float, 0, 60_000),
        default=250.0,
        help="delay between session starts (default: %(default)s)",
    )
    p.add_argument(
        "--arrivals",
        choices=("even", "poisson"),
        default="even",
        help="even: sessions start --stagger-ms apart and wait --gap-ms after each reply; poisson: "
        "exponential starts and waits of those means, as independent callers (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=_bounded(int, 0, 2**31 - 1),
        default=0,
        help="the draw of --arrivals poisson: the same seed, the same schedule (default: %(default)s)",
    )
    p.add_argument(
        "--gap-ms",
        type=_bounded(float, 0, 60_000),
        default=500.0,
        help="silence after response.done before the next turn (default: %(default)s)",
    )
    p.add_argument(
        "--timeout-s",
        type=_bounded(float, 1, 3600),
        default=30.0,
        help="limit per turn, from the end of its clip (the reply included); a late turn is recorded as failed (default: %(default)s)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=_bounded(float, 0.1, 600),
        default=10.0,
        help="limit to connect and start a session (default: %(default)s)",
    )
    p.add_argument(
        "--sample-rate",
        type=int,
        choices=RATES,
        default=16000,
        help="rate declared and sent (default: %(default)s)",
    )
    p.add_argument(
        "--output-rate",
        type=int,
        choices=RATES,
        default=None,
        help="reply audio rate to ask for (default: the server's)",
    )
    p.add_argument(
        "--threshold-dbfs",
        type=_bounded(float, -120, 0),
        default=-40.0,
        help="speech onset level per 10 ms block (default: %(default)s)",
    )
    p.add_argument(
        "--barge-in",
        action="store_true",
        help="speak over each reply and measure how fast playout stops",
    )
    p.add_argument(
        "--barge-in-after-ms",
        type=_bounded(float, 0, 60_000),
        default=600.0,
        help="wait after the reply becomes audible (default: %(default)s)",
    )
    p.add_argument(
        "--barge-in-audio",
        metavar="PATH",
        help="clip to barge in with (default: the next --audio clip)",
    )
    p.add_argument(
        "--backchannel-audio",
        metavar="PATH",
        help="speak this clip (an 'mm-hmm', an 'okay') over each reply, --barge-in-after-ms "
        "into it, and measure how long the reply pauses: a turn passes if the reply goes on",
    )
    p.add_argument("--system-prompt", help="session.start system_prompt")
    p.add_argument("--voice", help="session.start voice")
    p.add_argument("--token", help="API key, sent as 'Authorization: Bearer'")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write the full report here")
    p.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="write a latency plot per concurrency level (matplotlib)",
    )
    p.add_argument(
        "--save-audio", type=Path, metavar="DIR", help="write each turn's reply audio as WAV"
    )
    p.set_defaults(func=run_probe)


def _check_out(path: Path | None, what: str) -> None:
    from voicebot.errors import ConfigError

    if path is not None and not path.resolve().parent.is_dir():
        raise ConfigError(f"{what}: directory {path.resolve().parent} does not exist")


def run_probe(args: argparse.Namespace) -> int:
    """Exit codes: 0 every turn ok, 1 some turn failed (or the server is unreachable),
    2 bad arguments or files."""
    import asyncio
    import importlib.util
    from dataclasses import replace

    from voicebot.errors import ConfigError
    from voicebot.probe.client import ProbeConfig, check_reachable, run_level_measured
    from voicebot.probe.clips import load_clip
    from voicebot.probe.report import build_report, format_table, write_plot

    _check_out(args.json, "--json")
    _check_out(args.plot, "--plot")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib")
    if args.save_audio is not None and not args.save_audio.is_dir():
        raise ConfigError(f"--save-audio: {args.save_audio} is not a directory")
    clips = tuple(
        load_clip(p, args.sample_rate, threshold_dbfs=args.threshold_dbfs) for p in args.audio
    )
    if args.backchannel_audio and (args.barge_in or args.barge_in_audio):
        raise ConfigError("--backchannel-audio speaks over the reply in place of --barge-in: give one of them")
    barge_clip = None
    if args.backchannel_audio:
        barge_clip = load_clip(
            args.backchannel_audio, args.sample_rate, threshold_dbfs=args.threshold_dbfs
        )
    if args.barge_in_audio:
        barge_clip = load_clip(
            args.barge_in_audio, args.sample_rate, threshold_dbfs=args.threshold_dbfs
        )
    start_fields = {
        k: v for k, v in (("system_prompt", args.system_prompt), ("voice", args.voice)) if v
    }
    cfg = ProbeConfig(
        url=args.url,
        clips=clips,
        turns=args.turns,
        protocol=args.protocol,
        sample_rate=args.sample_rate,
        output_sample_rate=args.output_rate,
        stagger_s=args.stagger_ms / 1000,
        gap_s=args.gap_ms / 1000,
        arrivals=args.arrivals,
        seed=args.seed,
        timeout_s=args.timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        threshold_dbfs=args.threshold_dbfs,
        barge_after_s=args.barge_in_after_ms / 1000 if args.barge_in or args.backchannel_audio else None,
        barge_clip=barge_clip,
        backchannel=bool(args.backchannel_audio),
        token=args.token,
        start_fields=start_fields,
        save_audio=args.save_audio,
    )

    async def main() -> tuple[list[tuple[int, list[Any]]], list[dict[str, Any]]]:
        await check_reachable(cfg.url, cfg.connect_timeout_s)
        levels, costs = [], []
        for n in args.sessions:
            workers = args.workers or auto_workers(n)
            print(
                f"probe: {n} session(s) x {cfg.turns} turn(s), {workers} process(es) ...",
                file=sys.stderr,
                flush=True,
            )
            result = await run_level_measured(replace(cfg, workers=workers), n)
            levels.append((n, result.records))
            costs.append(result.stats.as_dict())
        return levels, costs

    levels, costs = asyncio.run(main())
    config = {
        "url": cfg.url,
        "protocol": cfg.protocol,
        "sessions": list(args.sessions),
        "turns": cfg.turns,
        "files": [c.path for c in clips],
        "sample_rate": cfg.sample_rate,
        "output_sample_rate": cfg.output_sample_rate,
        "stagger_ms": args.stagger_ms,
        "gap_ms": args.gap_ms,
        "arrivals": args.arrivals,
        "seed": args.seed,
        "timeout_s": cfg.timeout_s,
        "threshold_dbfs": cfg.threshold_dbfs,
        "barge_in_after_ms": args.barge_in_after_ms if args.barge_in or args.backchannel_audio else None,
        "backchannel_audio": args.backchannel_audio,
    }
    report = build_report(config, levels, probe=costs)
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        write_plot(report, args.plot)
    counts = report["counts"]
    if counts["ok"] < counts["turns"]:
        print(
            f"probe: {counts['turns'] - counts['ok']} of {counts['turns']} turns failed",
            file=sys.stderr,
        )
        return 1
    return 0
