"""The one pacer a transport uses where it paces reply frames onto its wire itself.

Reply audio is paced twice at most, and each pacing has its place:

- the call paces its reply audio in real time, ``session.playout_lead_ms`` ahead (the
  session's playout), so a transport gets frames about when they should play;
- a transport that queues frames behind other messages (Twilio/Telnyx: marks after
  their audio, a ``clear`` dropping what was not sent) sends them with :class:`Pacer`;
- WebRTC is not paced here: aiortc pulls one frame per 20 ms from the reply track, and
  the track's clock (``webrtc_tracks.ReplyTrack.recv``) stamps RTP timestamps that must
  stay continuous through silence. That is media clocking, not pacing, and stays there.
"""

from __future__ import annotations


class Pacer:
    """When the next 20 ms frame may go: real time, ``lead_s`` ahead, no catch-up.

    The call already paces reply audio; this keeps a transport's own queue from
    leaving in bursts (the call's lead, a late block). After an underrun (TTS slower
    than real time) the clock restarts instead of bursting to catch up.
    """

    def __init__(self, lead_s: float, frame_s: float = 0.02) -> None:
        self.lead_s, self.frame_s = lead_s, frame_s
        self._base: float | None = None
        self._count = 0  # frames sent since _base

    def delay(self, now: float) -> float:
        """Seconds to wait before sending the next frame (0: send now)."""
        if self._base is None or now - self._base > self._count * self.frame_s:
            self._base, self._count = now, 0  # idle or behind: restart the clock
        return max(0.0, self._base + self._count * self.frame_s - self.lead_s - now)

    def sent(self) -> None:
        self._count += 1

    def reset(self) -> None:
        self._base = None
