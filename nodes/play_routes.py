"""FAST-AR World Play's routes on ComfyUI's server: ``GET /fastar/play/{session}`` the play page
(``web/fastar_play.html``) and ``GET /fastar/play/{session}/ws`` its socket, both refused without the
session's token. To the page: JSON (``hello``, ``ack``, ``chunk``, ``restart``, ``end``, ``error``) and
binary frames (a 4-byte big-endian frame number, then a JPEG); from it ``{"action": "W+D", "id": n}``,
``{"stop": true}`` and ``{"restart": true}``."""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
from pathlib import Path

from ..fastar import FastARError
from ..fastar.play import Session

NODE = "FAST-AR World Play"
PAGE = Path(__file__).resolve().parent.parent / "web" / "fastar_play.html"
sessions: dict[str, "Live"] = {}  # the open ones, by id


class Live:
    """A session's server side: its sockets and a thread-safe way to send them messages."""

    def __init__(self, session: Session, hello: dict, loop):
        self.session, self.hello, self.loop = session, hello, loop
        self.queues: list[asyncio.Queue] = []
        self.connected = threading.Event()

    def send(self, message) -> None:
        """From any thread: to every page of the session (str: JSON text, bytes: a frame)."""
        def put():
            for q in self.queues:
                q.put_nowait(message)
        self.loop.call_soon_threadsafe(put)


def authorised(request) -> Live | None:
    """The session a request names, where it carries that session's token."""
    live = sessions.get(request.match_info["session"])
    token = request.query.get("token", "")
    return live if live is not None and secrets.compare_digest(token.encode(), live.session.token.encode()) else None


def register_routes(server) -> None:
    """The session's page and socket on ``server``'s route table (ComfyUI's PromptServer), once."""
    if server is None or getattr(server, "_fastar_play_routes", False):
        return
    from aiohttp import WSMsgType, web

    server._fastar_play_routes = True
    routes = server.routes

    @routes.get("/fastar/play/{session}")
    async def page(request):
        if authorised(request) is None:
            return web.Response(status=403, text="FAST-AR World Play: no such session, or a wrong token")
        return web.Response(text=PAGE.read_text(), content_type="text/html")

    @routes.get("/fastar/play/{session}/ws")
    async def socket(request):
        live = authorised(request)
        if live is None:
            return web.Response(status=403, text="FAST-AR World Play: no such session, or a wrong token")
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        live.queues.append(queue)
        await ws.send_str(json.dumps(live.hello))
        live.connected.set()

        async def pump():
            while True:
                message = await queue.get()
                if isinstance(message, bytes):
                    await ws.send_bytes(message)
                else:
                    await ws.send_str(message)
        sender = asyncio.ensure_future(pump())
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    data = json.loads(msg.data)
                    if data.get("stop") or data.get("restart"):
                        (live.session.stopping if data.get("stop") else live.session.restarting).set()
                        continue
                    seq, received = live.session.post(str(data["action"]))
                    await ws.send_str(json.dumps({"type": "ack", "seq": seq, "received": received,
                                                  "id": data.get("id")}))
                except (FastARError, KeyError, ValueError, TypeError) as exc:
                    await ws.send_str(json.dumps({"type": "error", "message": f"{NODE}: {exc}"}))
        finally:
            sender.cancel()
            live.queues.remove(queue)
            if not live.queues:  # the page closed: the session waits for it to come back
                live.connected.clear()
        return ws
