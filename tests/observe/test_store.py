"""Call records on disk: written whole from the writer thread, rotated by count and by
size, and an unwritable directory costs only the records (logged once, counted)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from voicebot.observe.store import RecordStore, record_name


def record(i: int, size: int = 10) -> dict[str, object]:
    return {"call_id": f"sess_{i:04d}", "started_at": f"2026-01-01T00:00:{i % 60:02d}.000Z", "pad": "x" * size}


def test_records_are_written_whole_and_handed_on(tmp_path: Path) -> None:
    outcomes: list[str] = []
    handed: list[tuple[str, bytes]] = []
    store = RecordStore(str(tmp_path / "calls"), max_files=100, max_bytes=1 << 20,
                        on_outcome=outcomes.append, then=lambda cid, body: handed.append((cid, body)))
    store.put(record(1))
    store.close(5.0)
    (path,) = (tmp_path / "calls").iterdir()
    assert path.name == record_name(record(1)) == "20260101T000001.000Z_sess_0001.json"
    assert json.loads(path.read_bytes()) == record(1)
    assert outcomes == ["written"] and handed == [("sess_0001", path.read_bytes())]


def test_the_oldest_records_go_beyond_the_count_and_the_size(tmp_path: Path) -> None:
    outcomes: list[str] = []
    (tmp_path / "20250101T000000.000Z_sess_old.json").write_text("{}")  # from before a restart
    store = RecordStore(str(tmp_path), max_files=3, max_bytes=1 << 20, on_outcome=outcomes.append)
    for i in range(5):
        store.put(record(i))
    store.close(5.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [record_name(record(i)) for i in (2, 3, 4)]

    sized = tmp_path / "sized"
    store = RecordStore(str(sized), max_files=100, max_bytes=2500, on_outcome=outcomes.append)
    for i in range(5):
        store.put(record(i, size=1000))
    store.close(5.0)
    assert sorted(p.name for p in sized.iterdir()) == [record_name(record(i)) for i in (3, 4)]
    assert sum(p.stat().st_size for p in sized.iterdir()) <= 2500


def test_the_workers_of_one_port_share_the_directorys_bounds(tmp_path: Path) -> None:
    """Each of K workers keeps 1/K of record_max_files (Telemetry's share); only the first
    rotates the records that were there before they started."""
    from voicebot.config import TelemetryConfig
    from voicebot.metrics import Metrics
    from voicebot.observe.telemetry import Telemetry

    old = tmp_path / "20250101T000000.000Z_sess_old.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 100, time.time() - 100))
    started = time.time() - 50  # the server's start: after the old record, before any new one
    cfg = TelemetryConfig(record_dir=str(tmp_path), record_max_files=4)
    stores = []
    for worker in (0, 1):
        telemetry = Telemetry(cfg, Metrics(), environ={}, share=(worker, 2, started))
        assert telemetry._share(cfg.record_max_files) == 2
        stores.append(RecordStore(str(tmp_path), max_files=telemetry._share(4), max_bytes=1 << 20,
                                  on_outcome=lambda _: None, existing_before=telemetry._existing_before))
    for i in range(6):
        stores[i % 2].put(record(10 + i))
    for store in stores:
        store.close(5.0)
    names = sorted(p.name for p in tmp_path.iterdir())
    # Worker 0 wrote 10, 12, 14 and kept its last two (the old one went first); worker 1
    # wrote 11, 13, 15 and kept its last two.
    assert names == [record_name(record(i)) for i in (12, 13, 14, 15)]


def test_an_unwritable_directory_is_counted_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    outcomes: list[str] = []
    handed: list[str] = []
    store = RecordStore(str(blocker / "calls"), max_files=10, max_bytes=1 << 20,
                        on_outcome=outcomes.append, then=lambda cid, _: handed.append(cid))
    with caplog.at_level(logging.INFO, "voicebot.observe.store"):
        for i in range(3):
            store.put(record(i))
        store.close(5.0)
    assert outcomes == ["failed"] * 3
    assert handed == ["sess_0000", "sess_0001", "sess_0002"], "the webhook still gets the records"
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_a_writer_that_is_behind_drops_records_counted(tmp_path: Path) -> None:
    outcomes: list[str] = []
    gate = __import__("threading").Event()
    store = RecordStore(str(tmp_path), max_files=1000, max_bytes=1 << 30, on_outcome=outcomes.append,
                        then=lambda *_: gate.wait(10))
    for i in range(300):  # the writer is held on the first: the queue fills
        store.put(record(i))
    assert outcomes.count("dropped") >= 300 - 256 - 1
    gate.set()
    store.close(10.0)
    assert outcomes.count("written") + outcomes.count("dropped") == 300
