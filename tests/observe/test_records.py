"""The call record's bounds and its reading of why a call ended (no call needed: the
recorder is fed the events a call tells its client)."""

from __future__ import annotations

import json

import pytest

from voicebot.observe.records import CallRecorder, hung_up_by
from voicebot.session import events as ev
from voicebot.tools.spec import ToolCall


@pytest.mark.parametrize(("reason", "who"), [
    ("client closed", "caller"), ("hangup", "caller"), ("call ended", "caller"), ("hangup digit", "caller"),
    ("server shutdown", "server"), ("idle_timeout", "server"), ("slow_consumer", "server"),
    ("engine_unavailable", "server"),
])
def test_who_hung_up(reason: str, who: str) -> None:
    assert hung_up_by(reason) == who


def test_a_long_call_keeps_its_first_turns_and_cuts_long_texts() -> None:
    rec = CallRecorder(max_turns=3, max_text_chars=20)
    rec.started("sess_1", "twilio", 100.0)
    for i in range(10):
        now = 101.0 + i
        rec.event(ev.TranscriptFinal(f"item_{i}", "word " * 50), now)
        rec.event(ev.ResponseStarted(f"resp_{i}", f"item_r{i}"), now)
        rec.event(ev.ResponseDone(f"resp_{i}", f"item_r{i}", "completed", "reply " * 50, "reply " * 50, 900), now + 0.5)
    rec.ended("call ended", 120.0)
    doc = rec.document()
    assert len(doc["turns"]) == 3 and doc["turns_left_out"] == 7
    assert doc["summary"]["turns"] == 10 and doc["summary"]["replies"] == 10
    turn = doc["turns"][0]
    assert turn["transcript"].startswith("word word") and turn["transcript"].endswith("[230 more characters]")
    assert len(turn["replies"][0]["text"]) < 60
    assert doc["protocol"] == "twilio" and doc["duration_s"] == 20.0 and doc["hung_up_by"] == "caller"
    assert len(json.dumps(doc)) < 3000


def test_a_transports_details_are_kept_bounded() -> None:
    rec = CallRecorder(max_turns=3, max_text_chars=20)
    rec.started("sess_3", "twilio", 0.0)
    assert rec.document()["details"] == {}
    rec.details({"carrier": "twilio", "carrier_call_id": "CA1", "from": "+15550100001"})
    rec.details({f"k{i}": "v" * 100 for i in range(100)})  # a transport gone wrong
    doc = rec.document()
    assert doc["details"]["carrier_call_id"] == "CA1" and doc["details"]["from"] == "+15550100001"
    assert len(doc["details"]) <= 3 + 16 and len(json.dumps(doc["details"])) < 2000


def test_tool_calls_meet_their_results_and_client_replies_get_a_turn() -> None:
    rec = CallRecorder(max_turns=10, max_text_chars=1000)
    rec.started("sess_2", "realtime", 0.0)
    rec.event(ev.ResponseStarted("resp_1", "item_1"), 1.0)  # response.create with no speech
    rec.event(ev.ToolCallDone("resp_1", ToolCall("call_1", "item_2", "weather", '{"city": "Oslo"}')), 1.2)
    rec.event(ev.ResponseDone("resp_1", "item_1", "completed", "", "", 0), 1.3)
    rec.event(ev.ToolResult("call_1", "weather", '{"sky": "clear"}'), 2.0)
    rec.event(ev.ResponseStarted("resp_2", "item_3"), 2.1)
    rec.event(ev.ResponseDone("resp_2", "item_3", "completed", "Clear skies.", "Clear skies.", 800), 3.0)
    rec.event(ev.ErrorEvent("invalid_value", "bad", None, False), 3.5)
    rec.ended("client closed", 4.0)
    doc = rec.document()
    (turn,) = doc["turns"]
    assert turn["transcript"] is None and [r["response_id"] for r in turn["replies"]] == ["resp_1", "resp_2"]
    (call,) = turn["replies"][0]["tool_calls"]
    assert call == {"call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}', "result": '{"sky": "clear"}'}
    assert doc["errors"] == [{"at_s": 3.5, "code": "invalid_value", "message": "bad", "fatal": False}]
    assert doc["summary"]["tool_calls"] == 1 and doc["summary"]["errors"] == 1


def test_a_client_truncate_after_the_reply_ended_says_what_was_heard() -> None:
    rec = CallRecorder(max_turns=10, max_text_chars=100)
    rec.started("sess_1", "openai-realtime", 100.0)
    rec.event(ev.TranscriptFinal("item_u1", "what is the weather"), 101.0)
    rec.event(ev.ResponseStarted("resp_1", "item_r1"), 101.5)
    rec.event(ev.ResponseDone("resp_1", "item_r1", "completed", "It is sunny and warm.", "It is sunny and warm.", 1800),
              103.3)
    rec.event(ev.ReplyTruncated("resp_1", "item_r1", 700, "It is"), 103.5)
    rec.event(ev.ReplyTruncated("resp_9", "item_r9", 100, "nothing"), 103.6)  # never told: ignored
    (reply,) = rec.document()["turns"][0]["replies"]
    assert reply["status"] == "completed" and reply["text"] == "It is sunny and warm."
    assert reply["heard"] == "It is" and reply["played_ms"] == 700
    assert reply["truncated"] == {"at_s": 3.5, "audio_end_ms": 700}
