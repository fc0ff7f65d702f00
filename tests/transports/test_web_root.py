"""Where the browser page is served from (``server.web_root``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from voicebot.config import load_config
from voicebot.server.app import create_app

REPO = Path(__file__).resolve().parents[2]


def test_the_default_web_root_serves_the_page_whatever_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server started from another directory (a service unit, `cd /srv && voicebot serve
    # --config /opt/voicebot/configs/default.yaml`) served no page at all: "web" was looked
    # up in the current directory only, and a missing folder was skipped without a word.
    monkeypatch.chdir(tmp_path)
    app = create_app(load_config(REPO / "configs/default.yaml"), load=False)
    page = TestClient(app).get("/")
    assert page.status_code == 200 and "<html" in page.text.lower()


def test_a_web_root_in_the_current_directory_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "index.html").write_text("<html>our own page</html>")
    monkeypatch.chdir(tmp_path)
    app = create_app(load_config(REPO / "configs/default.yaml"), load=False)
    assert "our own page" in TestClient(app).get("/").text


def test_a_missing_web_root_is_said_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(REPO / "configs/default.yaml", [f"server.web_root={tmp_path / 'nowhere'}"])
    with caplog.at_level(logging.WARNING, logger="voicebot.server.app"):
        app = create_app(cfg, load=False)
    assert TestClient(app).get("/").status_code == 404
    assert any("nowhere" in r.getMessage() and "not served" in r.getMessage() for r in caplog.records)
