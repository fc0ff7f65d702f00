"""The Kokoro clause batcher (voicebot/engines/tts/kokoro_batch.py) with a fake runner.

The runner is the batcher's own interface to the model (``Runner``): here a function that
records each batch, can be held in its worker thread until a test releases it, and
returns one float32 array per clause (its length = the clause's phoneme count).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

import numpy as np
import pytest

from voicebot.engines.tts.kokoro_batch import Clause, ClauseQueue, KokoroBatcher
from voicebot.errors import CapacityError, EngineError


class FakeRunner:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []  # per batch: each clause's first id
        self.blocking = False  # True: each forward waits for a release() token
        self.tokens = threading.Semaphore(0)
        self.entered = threading.Event()
        self.fail_next = False

    def __call__(self, batch: list[Clause], deliver: Callable[[list[Clause], list[np.ndarray]], None]) -> dict[str, float]:
        self.batches.append([c.ids[0] for c in batch])
        self.entered.set()
        if self.blocking:
            assert self.tokens.acquire(timeout=10)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("CUDA out of memory (fake)")
        # Two groups, as the torch runner delivers them: the first half, then the rest.
        half = max(1, len(batch) // 2)
        for group in (batch[:half], batch[half:]):
            live = [c for c in group if not c.future.cancelled()]
            if live:
                deliver(live, [np.full(len(c.ids), c.ids[0], np.float32) for c in live])
        return {"encode": 0.001 * len(batch), "sync": 0.002, "elsewhere": 1.0}

    def release(self, n: int = 1) -> None:
        self.tokens.release(n)

    def open(self) -> None:
        self.blocking = False
        self.tokens.release(100)


async def wait_entered(runner: FakeRunner) -> None:
    assert await asyncio.to_thread(runner.entered.wait, 5)
    runner.entered.clear()


@contextlib.asynccontextmanager
async def batcher(runner: FakeRunner, **kw: int):  # type: ignore[no-untyped-def]
    eng = KokoroBatcher(runner, max_batch=kw.get("max_batch", 8), queue_size=kw.get("queue_size", 64),
                        workers=kw.get("workers", 1), max_frames=kw.get("max_frames"))
    eng.start()
    try:
        yield eng
    finally:
        runner.open()
        await eng.aclose()


def _clause(deadline: float, frames: int | None = None) -> Clause:
    loop = asyncio.get_running_loop()
    return Clause(ids=[int(deadline)], style=None, speed=1.0, deadline=deadline, future=loop.create_future(),
                  durations=None if frames is None else [frames])


async def test_queue_is_earliest_deadline_first_and_bounded() -> None:
    q = ClauseQueue(3)
    a, b, c = _clause(30), _clause(10), _clause(20)
    for x in (a, b, c):
        q.push(x)
    with pytest.raises(CapacityError):
        q.push(_clause(5))
    assert q.remove(c) and not q.remove(c)
    assert len(q) == 2
    q.push(_clause(40))  # room again after the removal
    assert [x.ids[0] for x in q.pop(2)] == [10, 30]
    assert [x.ids[0] for x in q.pop(5)] == [40]
    assert len(q) == 0


async def test_a_clause_knows_its_speech_in_frames_forced_or_estimated_from_its_phonemes() -> None:
    loop = asyncio.get_running_loop()
    forced = Clause(ids=[1, 2, 3], style=None, speed=1.0, deadline=0.0, future=loop.create_future(), durations=[2, 3, 2])
    assert forced.frames == 7
    plain = Clause(ids=list(range(100)), style=None, speed=1.0, deadline=0.0, future=loop.create_future())
    assert plain.frames == 253  # 2.53 frames a phoneme, the real model's average
    fast = Clause(ids=list(range(100)), style=None, speed=2.0, deadline=0.0, future=loop.create_future())
    assert fast.frames == 126


async def test_queue_hands_out_no_more_speech_than_asked_but_always_the_clause_due_first() -> None:
    q = ClauseQueue(8)
    for deadline, frames in ((1, 150), (2, 100), (3, 40), (4, 10)):
        q.push(_clause(deadline, frames))
    assert [c.ids[0] for c in q.pop(8, max_frames=100)] == [1]  # alone over the bound: it still goes
    # 2 and 3 are 140 frames: 3 waits, and 4 (short enough) is not taken before it.
    assert [c.ids[0] for c in q.pop(8, max_frames=120)] == [2]
    assert [c.ids[0] for c in q.pop(8, max_frames=120)] == [3, 4]
    assert len(q) == 0


async def test_a_clause_due_soon_waits_for_one_short_forward_not_for_every_long_clause_queued() -> None:
    # 256 replies at once: third clauses (long, due later) queue up while second clauses
    # (due sooner) are still being written. Bounded forwards let those in between them.
    runner = FakeRunner()
    async with batcher(runner, max_batch=8, max_frames=200) as eng:
        runner.blocking = True
        first = asyncio.create_task(eng.synthesize([1], None, durations=[2]))
        await wait_entered(runner)
        long = [asyncio.create_task(eng.synthesize([i], None, deadline=float(i), durations=[100]))
                for i in (10, 11, 12, 13)]
        await asyncio.sleep(0.05)
        runner.release()  # forward 1 ends; forward 2 takes two long clauses (200 frames)
        await wait_entered(runner)
        urgent = asyncio.create_task(eng.synthesize([5], None, deadline=5.0, durations=[40]))
        await asyncio.sleep(0.05)
        runner.open()
        await asyncio.gather(first, urgent, *long)
    assert runner.batches == [[1], [10, 11], [5, 12], [13]]


async def test_clauses_waiting_behind_a_forward_go_in_one_batch() -> None:
    runner = FakeRunner()
    async with batcher(runner, max_batch=4) as eng:
        runner.blocking = True
        first = asyncio.create_task(eng.synthesize([1, 1], None))
        await wait_entered(runner)  # batch 1 holds the only worker
        later = [asyncio.create_task(eng.synthesize([i] * 3, None, deadline=float(i))) for i in (7, 3, 5, 2, 6, 4)]
        await asyncio.sleep(0.05)
        assert eng.queue_depth == 6
        runner.open()
        audio = await first
        outs = await asyncio.gather(*later)
    assert audio.tolist() == [1.0, 1.0]
    assert [o[0] for o in outs] == [7, 3, 5, 2, 6, 4]  # each clause gets its own audio
    # Earliest deadline first, at most max_batch per forward.
    assert runner.batches == [[1], [2, 3, 4, 5], [6, 7]]
    assert eng.stats.batches == 3 and eng.stats.max_batch_seen == 4
    assert eng.stats.sizes == {1: 1, 4: 1, 2: 1}  # forwards by their clauses: bounded by max_batch


async def test_recent_forwards_report_their_time_and_clauses() -> None:
    runner = FakeRunner()
    async with batcher(runner, max_batch=4) as eng:
        assert eng.forward_stats() == {}  # nothing run yet: nothing to report
        runner.blocking = True
        first = asyncio.create_task(eng.synthesize([1], None))
        await wait_entered(runner)
        later = [asyncio.create_task(eng.synthesize([i], None, deadline=float(i))) for i in range(2, 7)]
        await asyncio.sleep(0.05)
        await asyncio.sleep(0.02)  # the held forward's wall time is at least this long
        runner.open()
        await asyncio.gather(first, *later)
        stats = eng.forward_stats()
    assert runner.batches == [[1], [2, 3, 4, 5], [6]]
    assert stats["forward_rows_mean"] == 2.0  # 6 clauses in 3 forwards
    assert stats["forward_ms_p95"] >= 50.0 and stats["forward_ms_p50"] <= stats["forward_ms_p95"]
    # The phases the runner timed (a name the batcher does not know is left out) ...
    assert stats["encode_ms_p50"] == 1.0 and stats["encode_ms_p95"] == 4.0 and stats["sync_ms_p95"] == 2.0
    assert not any(k.startswith("elsewhere") for k in stats) and "encode_rows_mean" not in stats
    # ... and the clauses' wait in the queue: five of them waited behind the held forward.
    assert stats["queue_ms_p95"] >= 50.0 and stats["queue_ms_p50"] >= 50.0 and "queue_rows_mean" not in stats


async def test_cancelled_waiting_clause_never_reaches_the_model() -> None:
    runner = FakeRunner()
    async with batcher(runner) as eng:
        runner.blocking = True
        busy = asyncio.create_task(eng.synthesize([1], None))
        await wait_entered(runner)
        doomed = asyncio.create_task(eng.synthesize([2], None))
        kept = asyncio.create_task(eng.synthesize([3], None))
        await asyncio.sleep(0.05)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert eng.queue_depth == 1  # dropped at once, not when the forward ends
        runner.open()
        await busy
        assert (await kept).tolist() == [3.0]
    assert runner.batches == [[1], [3]]
    assert eng.stats.dropped == 1


async def test_cancelled_running_clause_is_discarded_and_the_others_delivered() -> None:
    runner = FakeRunner()
    async with batcher(runner) as eng:
        runner.blocking = True
        busy = asyncio.create_task(eng.synthesize([1], None))
        await wait_entered(runner)
        a = asyncio.create_task(eng.synthesize([2], None))
        b = asyncio.create_task(eng.synthesize([3], None))
        await asyncio.sleep(0.05)
        runner.release()
        await busy
        await wait_entered(runner)  # [2, 3] is running now
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        runner.release()
        assert (await a).tolist() == [2.0]
    assert runner.batches == [[1], [2, 3]]
    assert eng.stats.discarded == 1


async def test_full_queue_raises_capacity_error() -> None:
    runner = FakeRunner()
    async with batcher(runner, queue_size=2) as eng:
        runner.blocking = True
        busy = asyncio.create_task(eng.synthesize([1], None))
        await wait_entered(runner)
        waiting = [asyncio.create_task(eng.synthesize([i], None)) for i in (2, 3)]
        await asyncio.sleep(0.05)
        with pytest.raises(CapacityError):
            await eng.synthesize([4], None)
        runner.open()
        await asyncio.gather(busy, *waiting)


async def test_failing_forward_fails_its_batch_and_the_next_one_recovers() -> None:
    runner = FakeRunner()
    async with batcher(runner) as eng:
        runner.blocking = True
        busy = asyncio.create_task(eng.synthesize([1], None))
        await wait_entered(runner)
        runner.fail_next = True
        runner.open()
        with pytest.raises(EngineError, match="out of memory"):
            await busy
        assert eng.failure_streak == 1 and isinstance(eng.last_error, RuntimeError)
        assert (await eng.synthesize([5], None)).tolist() == [5.0]
        assert eng.failure_streak == 0


async def test_runner_that_forgets_a_clause_fails_it_instead_of_hanging() -> None:
    def forgetful(batch: list[Clause], deliver: Callable[[list[Clause], list[np.ndarray]], None]) -> None:
        deliver(batch[:1], [np.zeros(1, np.float32)])

    eng = KokoroBatcher(forgetful, max_batch=8, queue_size=8)
    eng.start()
    try:
        gate = asyncio.Event()

        async def clause(i: int) -> np.ndarray:
            await gate.wait()
            return await eng.synthesize([i], None)

        tasks = [asyncio.create_task(clause(i)) for i in (1, 2)]
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    finally:
        await eng.aclose()
    assert isinstance(results[0], np.ndarray)
    assert isinstance(results[1], EngineError)


async def test_aclose_fails_waiting_clauses_and_later_calls() -> None:
    runner = FakeRunner()
    eng = KokoroBatcher(runner, max_batch=8, queue_size=8)
    eng.start()
    runner.blocking = True
    busy = asyncio.create_task(eng.synthesize([1], None))
    await wait_entered(runner)
    waiting = asyncio.create_task(eng.synthesize([2], None))
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(eng.aclose())
    await asyncio.sleep(0.05)
    runner.open()
    await closing
    assert (await busy).tolist() == [1.0]  # a running forward finishes and delivers
    with pytest.raises(EngineError, match="closed"):
        await waiting
    with pytest.raises(EngineError, match="not started"):
        await eng.synthesize([3], None)
