"""When a compaction's summary may start without delaying a live reply.

A summary's prompt is prefilled in pieces, each one engine step that nothing preempts
(vLLM's priority lane reorders waiting requests only), so a live request that arrives
meanwhile waits for the step in flight. The only lever is when the summary starts:

- never while the caller's turn is open (they speak, or their turn ended and its reply
  is not written yet): its end is what a live request follows;
- best while the caller listens: the reply is written (its LLM and TTS work is done)
  and at least :data:`LISTEN_MIN_S` of its audio is still to play;
- otherwise only once :data:`GRACE_S` have passed since the reply's audio ended, the
  moment the caller most likely answers;
- whatever the above, at the deadline: when the room left before the history budget's
  hard trim is less than one exchange, waiting for a window could let the next exchange
  hit the trim, and the summary goes at once.

Plain state and time (the call's clock, seconds); no I/O.
"""

from __future__ import annotations

import math

# A caller answers a reply within about a second when they answer at once: this covers
# that and the client's own playout buffer.
GRACE_S = 1.5
# A summary's first prompt pieces take about a second on the CPU default: with less audio
# left than this, the caller may answer into them.
LISTEN_MIN_S = 1.0


class SummaryWindow:
    def __init__(self, grace_s: float = GRACE_S, listen_min_s: float = LISTEN_MIN_S) -> None:
        self.grace_s = grace_s
        self.listen_min_s = listen_min_s
        self.playing_until = -math.inf  # when the written reply's audio runs out
        self.quiet_from = -math.inf  # the grace after a reply's audio ends

    def reply_written(self, now: float, audio_s: float) -> None:
        self.playing_until = now + audio_s
        self.quiet_from = max(self.quiet_from, self.playing_until + self.grace_s)

    def reply_ended(self, now: float) -> None:
        """Its audio went out (or it was cut): the caller may answer now."""
        self.playing_until = -math.inf
        self.quiet_from = now + self.grace_s

    def deadline(self, room: int, exchange: int) -> bool:
        """``room``: tokens the history may still grow by before the hard trim;
        ``exchange``: what the last exchange (a turn and its reply) added."""
        return room < exchange

    def opens(self, now: float, *, turn_open: bool, deadline: bool) -> bool:
        if deadline:
            return True
        if turn_open:
            return False
        if now + self.listen_min_s <= self.playing_until:
            return True  # the caller listens
        return now >= self.quiet_from

    def wake_at(self, now: float, *, turn_open: bool) -> float | None:
        """When to ask again, where only the grace holds a summary back (a turn that is
        open brings the question back with its reply, or its end)."""
        if turn_open or self.quiet_from <= now:
            return None
        return self.quiet_from
