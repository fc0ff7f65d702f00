"""A request for what only another worker of this port holds, forwarded to it.

With ``server.workers`` the kernel hands each connection to any worker; most requests
are a whole call and stay where they land, but a few name something a sibling holds
(a WebRTC call's hang-up, by the call's id). Those go on to the owner over its Unix
socket (voicebot/server/siblings.py), with the headers the owner checks again, and its
answer comes back as it is. A forwarded request is never forwarded again.
"""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import Response

from voicebot.server.siblings import Siblings

FORWARDED = "x-voicebot-forwarded"
# What the owner needs to answer as if it had the request itself.
_HEADERS = ("authorization", "origin", "host", "content-type")
_TIMEOUT_S = 5.0


def owner_of(siblings: Siblings, request: Request, worker: int | None) -> int | None:
    """The sibling to forward to: ``worker`` if it is another worker of this port and the
    request did not already come from one; else None (answer here)."""
    if worker is None or siblings.count < 2 or request.headers.get(FORWARDED):
        return None
    if worker == siblings.index or not 0 <= worker < siblings.count:
        return None
    return worker


async def forward(siblings: Siblings, worker: int, request: Request) -> Response | None:
    """``request`` answered by ``worker``; None if that worker cannot be reached (it died,
    and what it held with it)."""
    headers = {name: value for name, value in request.headers.items() if name in _HEADERS}
    headers[FORWARDED] = str(siblings.index)
    transport = httpx.AsyncHTTPTransport(uds=str(siblings.socket_path(worker)))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=_TIMEOUT_S) as client:
            answer = await client.request(request.method, request.url.path, headers=headers,
                                          content=await request.body())
    except httpx.TransportError:
        return None
    return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
