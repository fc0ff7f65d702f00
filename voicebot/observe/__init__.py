"""What calls leave behind for an operator: each call's record, its trace, the
end-of-call webhook, and logs that carry the call id.

The session reports what happened through one seam (voicebot/session/observer.py);
``telemetry.Telemetry`` builds each call's observer from ``telemetry.*`` and the
``OTEL_*`` environment, and owns the shared sinks. Per call, the work is per turn
and per event the call tells its client, never per audio frame, except for the
call's audio when ``telemetry.record_audio`` asks for it (call_audio.py).
"""
