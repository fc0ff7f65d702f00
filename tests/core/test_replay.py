"""A call recorded with session.record replays to the same decisions, from its events
alone: the turn ends, the replies started and released, the reply paused by speech
and the barge-in its words made of it."""

from __future__ import annotations

from pathlib import Path

from fakes import call, make_engines, with_session_cfg

from voicebot.cli import main
from voicebot.core import events as ce
from voicebot.core.replay import SHOWN, describe, replay
from voicebot.session import events as ev


async def test_a_recorded_call_replays_to_its_decisions(tokenizer, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    with_session_cfg(engines, record=str(tmp_path / "{session}.jsonl"))
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(500)  # a pause (speculation), then the end of the turn
        await c.wait_for(ev.ResponseAudioStarted)
        await c.pause(0.6)
        await c.speak(260)  # speech over the reply pauses it
        c.session.listener.asr.hear("Hold on")  # type: ignore[attr-defined]  # words: a barge-in
        barge = await c.wait_for(ev.BargeIn)
        sid = c.session.id
    recorded = tmp_path / f"{sid}.jsonl"
    lines = recorded.read_text().splitlines()
    assert len(lines) > 5

    decisions = [(t, a) for t, a in replay(lines) if isinstance(a, SHOWN)]
    again = [(t, a) for t, a in replay(lines) if isinstance(a, SHOWN)]
    assert decisions == again, "deterministic"
    kinds = [type(a) for _, a in decisions]
    assert kinds[:4] == [ce.OpenTurn, ce.StartReply, ce.EndTurn, ce.ReleaseReply], kinds
    start = decisions[1][1]
    assert isinstance(start, ce.StartReply) and start.gated, "prepared at the pause, released at the end"
    assert start.reply_id == barge.response_id
    pause = next(a for _, a in decisions if isinstance(a, ce.PauseReply))
    stop = next(a for _, a in decisions if isinstance(a, ce.StopReply))
    assert pause == ce.PauseReply(barge.response_id) and stop == ce.StopReply(barge.response_id, "interrupted", True)
    times = [t for t, _ in decisions]
    assert times == sorted(times) and 0.3 < times[2] - times[0] < 1.2, times

    assert main(["replay", str(recorded)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(None, 1)[1] for line in out] == [describe(a) for _, a in decisions]
