"""Ephemeral client secrets: short-lived credentials a browser or a Twilio stream opens
a call with, and the Realtime session config minted with one (``client_secrets``).

A server of several workers (``server.workers``) mints a secret in one process and
sees it used in another, so there they are files in the server's private folder, named
by the secret's SHA-256 (a directory listing shows no secret) and written whole by a
rename; a server of one process keeps them in a dict. Either way at most
:data:`MAX_SECRETS` are outstanding: more are refused rather than grown.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from voicebot.errors import CapacityError

MAX_SECRETS = 10_000


class ClientSecrets:
    def __init__(self, directory: Path | None = None) -> None:
        self._dir = directory
        if directory is not None:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # In memory: secret -> (expiry, wall clock; the session config minted with it).
        self._live: dict[str, tuple[float, dict[str, Any]]] = {}

    def mint(self, ttl_s: float, session: dict[str, Any] | None = None) -> tuple[str, float]:
        """A new secret valid for ``ttl_s``, and its expiry (Unix time)."""
        now = time.time()
        if self._count_live(now) >= MAX_SECRETS:
            raise CapacityError("too many outstanding client secrets")
        value = "ek_" + secrets.token_urlsafe(24)
        expires = now + ttl_s
        if self._dir is None:
            self._live[value] = (expires, dict(session or {}))
        else:
            path = self._path(value)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"expires": expires, "session": session or {}}))
            os.utime(tmp, (expires, expires))  # the expiry as mtime: counted without reading
            tmp.replace(path)
        return value, expires

    def session(self, value: str | None) -> dict[str, Any] | None:
        """The session config of a live secret ({} if it was minted without one); None
        if ``value`` is no live secret."""
        if not value:
            return None
        now = time.time()
        if self._dir is None:
            entry = self._live.get(value)
        else:
            try:
                data = json.loads(self._path(value).read_text())
                entry = (float(data["expires"]), dict(data["session"]))
            except (OSError, ValueError, KeyError, TypeError):
                entry = None
        if entry is None or entry[0] < now:
            return None
        return dict(entry[1])

    def valid(self, value: str | None) -> bool:
        return self.session(value) is not None

    def __len__(self) -> int:
        return self._count_live(time.time())

    def _count_live(self, now: float) -> int:
        """Outstanding secrets, the expired ones deleted on the way."""
        if self._dir is None:
            for key in [k for k, (exp, _) in self._live.items() if exp < now]:
                del self._live[key]
            return len(self._live)
        live = 0
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if not entry.name.endswith(".secret"):
                    continue
                try:
                    expires = entry.stat().st_mtime
                except OSError:
                    continue  # another worker deleted it
                if expires < now:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                else:
                    live += 1
        return live

    def _path(self, value: str) -> Path:
        assert self._dir is not None
        return self._dir / (hashlib.sha256(value.encode()).hexdigest() + ".secret")
