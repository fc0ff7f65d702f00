"""Reply quality: how often the bot echoes the caller instead of answering.

    .venv/bin/python benchmarks/echo_rate.py --json artifacts/echo/pipeline.json
    .venv/bin/python benchmarks/echo_rate.py --mode text --json artifacts/echo/text.json

A fixed set of spoken questions and requests (``QUESTIONS``, synthesised once with the
default Piper voice into ``--clips``) plus the real recordings in ``../shared/audio``
(LibriVox read speech, goforward, jfk), grouped into calls of ``--turns-per-call`` turns.

``--mode pipeline`` (default) measures what a caller gets: the real server on
``--config`` (started here, or ``--url`` of one already running), each call a probe
session over the native protocol that speaks its clips in real time and records the
server's final transcript and the reply text (voicebot/probe). ``--mode text`` skips
ASR and TTS: the LLM engine of ``--config`` answers the same turns through the
session's own prompt building (``Conversation``), from the reference texts or from the
transcripts of an earlier pipeline run (``--transcripts``); it is for quick iteration
on prompts and sampling, and for TTFT with nothing else competing (``--concurrency 1``).
Given a benchmarks/turn_taking.py JSON as ``--transcripts``, text mode answers that
run's spoken prompts (read passages, JFK) instead, as one call with ``--turns-per-call 8``.

Echo (per reply): the share of the reply's content words (lower-cased words minus a
fixed list of function words, see ``STOPWORDS``; counted with repeats) that also occur
among the content words of what the bot heard (the final transcript) is at least
``ECHO_SHARE`` (70%). Why 70%: an answer to a short question that restates its topic
brings about one word of its own for every two it reuses ("What is the capital of
France?" -> "The capital of France is Paris.": 2 of 3 reused, 67%), while an echo,
verbatim or rephrased ("You want to know what time we open on Sundays?": 3 of 3), brings
none or almost none. The report gives the rate at 50/60/70/80% too, so the cut can be
judged on the data. A reply with no content word at all ("Sure, I can.") is not an echo.

Replies sized for the ear (per reply): its words (p50/p95), whether it ran into
``llm.max_tokens`` (text mode applies the session's stopping rule: past ``max_tokens -
llm.wind_down_tokens`` the reply stops at its next sentence end, and one that reaches
``max_tokens`` drops its unfinished sentence), whether it ends mid-sentence, and
whether it says "as an AI" or uses list markup (a line starting "-", "*", "1.").

Answered (per turn): a non-empty reply that is not an echo and brings at least one
content word that the caller did not say ("Paris"). This is a proxy (no judge model is
available offline): it counts a reply that says something beyond the question; it
does not check that it is right.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import JSON_EPILOG, results_of, summarise_ms, write_result  # noqa: E402  (benchmarks/, beside this file)

ROOT = Path(__file__).resolve().parent.parent
SHARED_AUDIO = ROOT.parent / "shared" / "audio"

# What callers ask a voice agent: hours, bookings, orders, small talk, facts, one-word
# answers. Order matters only for grouping into calls (3 turns each by default).
QUESTIONS: tuple[str, ...] = (
    "What time do you open on Sundays?",
    "Can you spell your name?",
    "How much does a large pizza cost?",
    "I'd like to book a table for two tonight.",
    "What's the weather going to be like tomorrow?",
    "Can you tell me a joke?",
    "How do I reset my password?",
    "Where is the nearest train station?",
    "What is the capital of France?",
    "How many days are there in a leap year?",
    "Can you help me change my delivery address?",
    "I want to cancel my subscription.",
    "What's your name?",
    "Do you take credit cards?",
    "How long does shipping usually take?",
    "Is there parking near the store?",
    "Can I speak to a real person?",
    "What should I cook for dinner tonight?",
    "How do you boil an egg?",
    "Remind me to call my mother at six.",
    "What's the difference between a cold and the flu?",
    "Recommend a good book for a long flight.",
    "How far is the moon from the earth?",
    "Why is the sky blue?",
    "Can you repeat that, please?",
    "My order arrived damaged. What can I do?",
    "Do you have any vegetarian options?",
    "What is two plus two?",
    "How do you say good morning in Spanish?",
    "Yes.",
    "No, thanks.",
    "Tell me something interesting about octopuses.",
    "How do I get to the airport from downtown?",
    "Are you open on public holidays?",
    # Prompts that draw long replies from a small model: opinions, how-tos, lists.
    "What do you think about politics?",
    "Explain how a car engine works.",
    "What are the steps to bake bread?",
    "What can you help me with?",
    "Ask not what your country can do for you, ask what you can do for your country.",
)

# Function words and dialogue filler: reusing them says nothing about echoing.
STOPWORDS = frozenset(
    """a an the and or but if then so than that this these those there here it its it's
    i i'm i'd i'll i've me my mine we we're we'll we've us our ours you you're you'd you'll
    you've your yours he she they them their his her him what what's which who whom whose
    when where why how is are was were be been being am do does did doing done have has
    had having can could will would shall should may might must not no yes yeah okay ok
    of to in on at by for with about from into over under up down out off as just also
    too very really please thanks thank sure well oh hi hello hey like want wants need
    know let let's get got go going tell say said ask asked any some all more most much
    many one ones there's that's don't doesn't didn't can't won't isn't aren't""".split()
)

ECHO_SHARE = 0.7
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def content_words(text: str) -> list[str]:
    """Lower-cased content words, plural/possessive 's' dropped ("Sundays" = "sunday")."""
    words = []
    for w in _WORD.findall(text.lower().replace("\u2019", "'")):
        if w in STOPWORDS:
            continue
        w = w.removesuffix("'s")
        if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
            w = w[:-1]
        words.append(w)
    return words


def overlap(reply: str, heard: str) -> float | None:
    """Share of the reply's content words found in what was heard; None: no content word."""
    words = content_words(reply)
    if not words:
        return None
    said = set(content_words(heard))
    return sum(w in said for w in words) / len(words)


def is_echo(reply: str, heard: str, share: float = ECHO_SHARE) -> bool:
    o = overlap(reply, heard)
    return o is not None and o >= share


def is_answer(reply: str, heard: str) -> bool:
    said = set(content_words(heard))
    new = [w for w in content_words(reply) if w not in said]
    return bool(reply.strip()) and not is_echo(reply, heard) and len(new) >= 1


@dataclass
class Turn:
    call: int
    turn: int
    clip: str
    reference: str
    heard: str = ""  # the final transcript (pipeline) or the text given (text mode)
    reply: str = ""
    status: str = "ok"
    overlap: float | None = None
    echo: bool = False
    answered: bool = False
    ttft_ms: float | None = None
    cached_prompt_tokens: int | None = None
    prompt_tokens: int | None = None
    voice_to_voice_ms: float | None = None
    first_clause_tokens: int | None = None  # text mode: tokens generated before TTS can start
    first_clause: str = ""
    cut_at_limit: bool = False  # ran into max_tokens (text mode)
    errors: list[str] = field(default_factory=list)

    def judge(self) -> None:
        self.overlap = overlap(self.reply, self.heard)
        self.echo = is_echo(self.reply, self.heard)
        self.answered = self.status == "ok" and is_answer(self.reply, self.heard)


_AS_AN_AI = re.compile(r"\bas an ai\b|\blanguage model\b", re.IGNORECASE)
_LIST_MARKUP = re.compile(r"(?m)^\s*(?:[-*\u2022]|\d+[.)])\s")


def _p95(values: list[int]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))])


def _ends_sentence(text: str) -> bool:
    from voicebot.session.clauses import sentence_end

    text = text.strip()
    return not text or sentence_end(text) == len(text)


def summarise(turns: list[Turn]) -> dict[str, Any]:
    n = len(turns)
    replied = [t for t in turns if t.reply.strip()]
    ttft = [t.ttft_ms for t in turns if t.ttft_ms is not None]
    first_ttft = [t.ttft_ms for t in turns if t.ttft_ms is not None and t.turn == 0]
    later_ttft = [t.ttft_ms for t in turns if t.ttft_ms is not None and t.turn > 0]
    v2v = [t.voice_to_voice_ms for t in turns if t.voice_to_voice_ms is not None]
    words = [len(t.reply.split()) for t in replied]
    clause_tokens = [float(t.first_clause_tokens) for t in turns if t.first_clause_tokens is not None]
    return {
        "turns": n,
        "replied": len(replied),
        "echoes": sum(t.echo for t in turns),
        "echo_rate": round(sum(t.echo for t in turns) / n, 3) if n else None,
        "echo_rate_at": {
            str(s): round(sum(is_echo(t.reply, t.heard, s) for t in turns) / n, 3) if n else None
            for s in (0.5, 0.6, 0.7, 0.8)
        },
        "answered": sum(t.answered for t in turns),
        "answer_rate": round(sum(t.answered for t in turns) / n, 3) if n else None,
        "reply_words_p50": statistics.median(words) if words else None,
        "reply_words_p95": _p95(words),
        "cut_at_max_tokens": sum(t.cut_at_limit for t in turns),
        "ends_mid_sentence": sum(not _ends_sentence(t.reply) for t in replied),
        "as_an_ai": sum(bool(_AS_AN_AI.search(t.reply)) for t in replied),
        "list_markup": sum(bool(_LIST_MARKUP.search(t.reply)) for t in replied),
        "ttft_ms": summarise_ms(ttft),
        "ttft_ms_first_turn": summarise_ms(first_ttft),
        "ttft_ms_later_turns": summarise_ms(later_ttft),
        "voice_to_voice_ms": summarise_ms(v2v),
        # a count of tokens, not milliseconds: the same summary
        "first_clause_tokens": summarise_ms(clause_tokens),
    }


# ------------------------------------------------------------------- the turn set
@dataclass(frozen=True)
class Item:
    clip: Path
    reference: str


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:40]


def synthesise_questions(voice_dir: Path, out: Path) -> list[Item]:
    """Each question as a WAV (Piper, the default voice), with 0.3 s of silence around
    it; made once and reused (named after the text)."""
    import numpy as np
    import soundfile as sf

    out.mkdir(parents=True, exist_ok=True)
    items, voice = [], None
    for i, text in enumerate(QUESTIONS):
        path = out / f"q{i:02d}_{_slug(text)}.wav"
        if not path.exists():
            if voice is None:
                from voicebot.engines.tts.piper import _load_voice, find_voice_files

                voice = _load_voice(*find_voice_files(voice_dir))
            rate = voice.config.sample_rate
            audio = np.concatenate([c.audio_float_array for c in voice.synthesize(text)])
            pad = np.zeros(int(0.3 * rate), dtype=np.float32)
            sf.write(path, np.concatenate([pad, audio, pad]), rate, subtype="PCM_16")
        items.append(Item(path, text))
    return items


def recorded_items(folder: Path = SHARED_AUDIO) -> list[Item]:
    return [Item(w, w.with_suffix(".txt").read_text().strip()) for w in sorted(folder.glob("*.wav"))]


def calls_of(items: list[Item], per_call: int) -> list[list[Item]]:
    return [items[i : i + per_call] for i in range(0, len(items), per_call)]


def text_turns(items: list[Item], transcripts: Path | None) -> list[tuple[Item, str]]:
    """Text mode's turns: each item's reference text, or what an earlier run heard: an
    echo_rate pipeline JSON (its transcripts, by clip), or a turn_taking JSON (the
    transcripts of its first variant's turns, in order, instead of this set: a caller
    who reads passages aloud; ``--turns-per-call`` as its turns for one call as there)."""
    if transcripts is None:
        return [(it, it.reference) for it in items]
    doc = results_of(json.loads(transcripts.read_text()))
    if "variants" in doc:  # turn_taking.py
        return [(Item(Path(t["prompt"]), t["transcript"]), t["transcript"]) for t in doc["variants"][0]["turns"]]
    heard = {it.clip.name: it.reference for it in items}
    for t in doc["turns"]:
        heard[t["clip"]] = t["heard"]
    return [(it, heard[it.clip.name]) for it in items]


# --------------------------------------------------------------------- pipeline
async def run_pipeline_call(url: str, index: int, items: list[Item], args: argparse.Namespace) -> list[Turn]:
    from voicebot.probe.client import ProbeConfig, run_level
    from voicebot.probe.clips import load_clip

    clips = tuple(load_clip(str(it.clip), 16000) for it in items)
    start = {"system_prompt": args.system_prompt} if args.system_prompt else {}
    cfg = ProbeConfig(url=url, clips=clips, turns=len(clips), timeout_s=args.timeout_s, gap_s=0.5,
                      start_fields=start)
    records = await run_level(cfg, 1)
    turns = []
    for rec, it in zip(records, items, strict=True):
        t = Turn(index, rec.turn, it.clip.name, it.reference, heard=rec.transcript, reply=rec.reply_text,
                 status=rec.status, voice_to_voice_ms=rec.voice_to_voice_ms, errors=rec.errors)
        t.ttft_ms = rec.timings.get("llm_ttft_ms")
        t.cached_prompt_tokens, t.prompt_tokens = rec.cached_tokens, rec.prompt_tokens
        turns.append(t)
    return turns


async def run_pipeline(calls: list[list[Item]], args: argparse.Namespace) -> list[Turn]:
    url = args.url
    server = None
    if url is None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from serverproc import ServerProcess

        server = ServerProcess(config=args.config, overrides=tuple(args.set),
                               log_path=Path(args.json or "artifacts/echo/x").with_suffix(".server.log"))
        await asyncio.to_thread(server.start)
        url = server.ws + "/ws"
    try:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int, items: list[Item]) -> list[Turn]:
            async with gate:
                print(f"call {i + 1}/{len(calls)}", file=sys.stderr, flush=True)
                return await run_pipeline_call(url, i, items, args)

        results = await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)
    return [t for r in results for t in r]


# ------------------------------------------------------------------------- text
async def _text_call(llm: Any, cfg: Any, index: int, items: list[tuple[Item, str]], variant: dict[str, Any]) -> list[Turn]:
    from voicebot.engines.contracts import GenerationStats, Lane
    from voicebot.session.clauses import ClauseChunker, sentence_end, up_to_sentence_end
    from voicebot.session.history import Conversation

    max_tokens = variant.get("max_tokens", cfg.llm.max_tokens)
    wind_down = variant.get("wind_down_tokens", cfg.llm.wind_down_tokens)
    conv = Conversation(llm.tokenizer, variant["system_prompt"], cfg.session.history_tokens, max_tokens)
    for user, reply in variant.get("examples", []):  # few-shot as chat turns before the call
        conv.append("user", user)
        conv.append("assistant", reply)
    out = []
    for k, (it, heard) in enumerate(items):
        conv.append("user", heard)
        st = GenerationStats(request_id="", lane=Lane.INTERACTIVE)
        text, ids = [], []
        # The session's chunker over the stream: how many tokens the first clause waited for.
        chunker, first = ClauseChunker(cfg.session.first_clause_words, cfg.session.max_clause_words), None
        # The session's stopping rule (voicebot/session/response.py).
        async for d in llm.generate(conv.prompt_ids(), stats=st, temperature=variant.get("temperature"),
                                    max_tokens=max_tokens):
            piece, done = d.text, False
            if wind_down and len(ids) + d.token_count >= max_tokens - wind_down:
                piece, done = up_to_sentence_end("".join(text), d.text)
            text.append(piece)
            ids.extend(d.token_ids)
            if first is None and (cut := chunker.push(piece)):
                first = (cut[0], len(ids))
            if done:
                break
        reply = "".join(text).strip()
        cut_at_limit = st.finish_reason == "length"
        if cut_at_limit and wind_down:
            reply = reply[: sentence_end(reply)] or reply
        conv.append("assistant", reply, token_ids=ids)
        if first is None and (rest := chunker.flush()):
            first = (rest, len(ids))
        t = Turn(index, k, it.clip.name, it.reference, heard=heard, reply=reply, cut_at_limit=cut_at_limit)
        if first is not None:
            t.first_clause, t.first_clause_tokens = first
        t.ttft_ms = None if st.ttft_s is None else round(1000 * st.ttft_s, 1)
        t.cached_prompt_tokens, t.prompt_tokens = st.cached_tokens, st.prompt_tokens
        out.append(t)
    return out


_PENALTY: dict[str, float] = {}  # the running variant's repetition_penalty (text mode)


def _penalty_hook(llm: Any) -> None:
    """Text mode: a variant may try vLLM's ``repetition_penalty`` (tokens of the prompt,
    the caller's words among them, and of the reply so far), which LlmConfig does not
    expose: set on the SamplingParams the engine builds."""
    build = llm._sampling

    def sampling(*a: Any, **kw: Any) -> Any:
        params = build(*a, **kw)
        if _PENALTY.get("value"):
            params.repetition_penalty = _PENALTY["value"]
        return params

    llm._sampling = sampling


async def run_text(
    calls: list[list[tuple[Item, str]]], args: argparse.Namespace, variants: list[dict[str, Any]]
) -> list[list[Turn]]:
    """LLM only, through the session's prompt building; each call its own Conversation.
    One engine for every variant ({"name", "system_prompt", "temperature", "examples":
    [[user, reply], ...] as chat turns before the call}); one list of turns per variant."""
    from voicebot.config import load_config
    from voicebot.engines.registry import resolve_specs
    from voicebot.session.history import Conversation

    cfg = load_config(args.config, list(args.set))
    llm = (await resolve_specs(cfg)).llm()
    await llm.start()
    _penalty_hook(llm)
    runs = []
    try:
        for variant in variants:
            _PENALTY["value"] = variant.get("repetition_penalty", 0.0)
            if args.warm:  # the system prompt in the prefix cache, as on a server that took a call
                warm = Conversation(llm.tokenizer, variant["system_prompt"], 4096, 8).prompt_ids("Hi.")
                async for _ in llm.generate(warm, max_tokens=1):
                    pass
            gate = asyncio.Semaphore(args.concurrency)

            async def one(
                i: int, items: list[tuple[Item, str]], variant: dict[str, Any] = variant, gate: asyncio.Semaphore = gate
            ) -> list[Turn]:
                async with gate:
                    return await _text_call(llm, cfg, i, items, variant)

            results = await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
            runs.append([t for r in results for t in r])
    finally:
        await llm.aclose()
    return runs


# ------------------------------------------------------------------------- main
def print_report(summary: dict[str, Any], turns: list[Turn], show: int) -> None:
    for t in turns[:show]:
        mark = "ECHO" if t.echo else ("ok  " if t.answered else "--  ")
        o = "  - " if t.overlap is None else f"{t.overlap:4.2f}"
        print(f"{mark} {o}  {t.heard[:60]!r:64} -> {t.reply[:100]!r}")
    print(json.dumps(summary, indent=2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--mode", choices=("pipeline", "text"), default="pipeline")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--url", help="pipeline: ws://.../ws of a running server (default: start one)")
    p.add_argument("--system-prompt", help="instead of the config's (pipeline: sent in session.start)")
    p.add_argument("--turns-per-call", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="calls at once")
    p.add_argument("--timeout-s", type=float, default=90.0)
    p.add_argument("--clips", type=Path, default=ROOT / "artifacts" / "echo" / "clips")
    p.add_argument("--transcripts", type=Path, help="text mode: the transcripts of this pipeline JSON, or of a "
                   "benchmarks/turn_taking.py JSON (its spoken prompts instead of this set)")
    p.add_argument("--warm", action="store_true", help="text mode: cache the system prompt before timing")
    p.add_argument("--variants", type=Path, help="text mode: JSON list of {name, system_prompt, temperature, "
                   "max_tokens, wind_down_tokens, repetition_penalty}")
    p.add_argument("--show", type=int, default=100, help="turns to print")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from voicebot.config import load_config

    cfg = load_config(args.config, list(args.set))
    from voicebot.provision import resolve_model

    voice = Path(resolve_model(cfg.tts.voice, cfg.models))
    items = synthesise_questions(voice, args.clips) + recorded_items()
    t0 = time.monotonic()
    config = {"mode": args.mode, "config": args.config, "set": args.set, "temperature": cfg.llm.temperature,
              "top_p": cfg.llm.top_p, "turns_per_call": args.turns_per_call, "concurrency": args.concurrency}
    default = {"name": "config", "system_prompt": args.system_prompt or cfg.session.system_prompt}
    if args.mode == "pipeline":
        runs = [(default, asyncio.run(run_pipeline(calls_of(items, args.turns_per_call), args)))]
    else:
        pairs = text_turns(items, args.transcripts)
        variants = json.loads(args.variants.read_text()) if args.variants else [default]
        runs = list(zip(variants, asyncio.run(run_text(calls_of(pairs, args.turns_per_call), args, variants)),
                        strict=True))  # type: ignore[arg-type]
    results = []
    for variant, turns in runs:
        for t in turns:
            t.judge()
        summary = summarise(turns)
        print(f"=== {variant.get('name')}")
        print_report(summary, turns, args.show)
        results.append({"variant": variant, "summary": summary, "turns": [asdict(t) for t in turns]})
    print(f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.json:
        out = {"config": config, **results[0]} if len(results) == 1 else {"config": config, "variants": results}
        write_result(args.json, "echo_rate", args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
