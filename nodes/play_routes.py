"""FAST-AR World Play's routes on ComfyUI's server: ``GET /fastar/play/{session}`` the play page
(``web/fastar_play.html``) and ``GET /fastar/play/{session}/ws`` its socket, both refused without the
session's token. To the page: JSON (``hello``, ``ack``, ``chunk``, ``restart``, ``end``, ``error``) and
binary frames (a 4-byte big-endian frame number, then a JPEG); from it ``{"action": "W+D", "id": n}``,
``{"stop": true}`` and ``{"restart": true}``. Every other message is answered with an ``error`` on a socket
that stays open; the sockets close when their session ends.

The token is the only key to a session: it goes to the client that queued it (``fastar.play``) and
nowhere else (not the log, not other clients)."""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections import deque
from pathlib import Path

from ..fastar import FastARError
from ..fastar.play import Session

NODE = "FAST-AR World Play"
PAGE = Path(__file__).resolve().parent.parent / "web" / "fastar_play.html"
MAX_MESSAGE = 1 << 16  # bytes of a page message the socket reads (and answers); a larger one closes it
sessions: dict[str, "Live"] = {}  # the open ones, by id
_CLOSE = object()  # a page's queue's last item: the session ended


class Outbox:
    """One page's messages to send, bounded: a page slower than the session loses its oldest frames
    first, then its oldest messages, never the newest and never the end; the memory is that of
    ``frames`` frames and ``messages`` messages whatever the page does."""

    def __init__(self, frames: int = 24, messages: int = 64):
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self.limits, self.frames, self.dropped = (frames, messages), 0, 0

    def put(self, message) -> None:
        """On the server's loop."""
        self.items.append(message)
        self.frames += isinstance(message, bytes)
        while self.frames > self.limits[0]:
            self._drop(bytes)
        while len(self.items) - self.frames > self.limits[1]:
            self._drop(str)
        self.ready.set()

    def _drop(self, kind) -> None:
        for i, item in enumerate(self.items):
            if isinstance(item, kind):
                del self.items[i]
                self.frames -= kind is bytes
                self.dropped += 1
                return

    async def get(self):
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.popleft()
        self.frames -= isinstance(item, bytes)
        return item


class Live:
    """A session's server side: its pages' outboxes and a thread-safe way to send them messages."""

    def __init__(self, session: Session, hello: dict, loop):
        self.session, self.hello, self.loop = session, hello, loop
        self.pages: list[Outbox] = []
        self.connected = threading.Event()
        self.closed = False

    def send(self, message) -> None:
        """From any thread: to every page of the session (str: JSON text, bytes: a frame)."""
        self.loop.call_soon_threadsafe(lambda: [page.put(message) for page in self.pages])

    def close(self) -> None:
        """From any thread, after the last message: every page's socket closes once it has been sent."""
        def close():
            self.closed = True
            for page in self.pages:
                page.put(_CLOSE)
        self.loop.call_soon_threadsafe(close)


def authorised(request) -> Live | None:
    """The session a request names, where it carries that session's token."""
    live = sessions.get(request.match_info["session"])
    token = request.query.get("token", "")
    return live if live is not None and secrets.compare_digest(token.encode(), live.session.token.encode()) else None


def handle(live: Live, text: str) -> dict | None:
    """A page's message: acted on, and its answer (an ``ack`` or an ``error``; None for stop and restart)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not ({"action", "stop", "restart"} & data.keys()):
        return {"type": "error", "message": f"{NODE}: a message from the page is a JSON object: "
                                           f"{{\"action\": \"W+D\"}}, {{\"stop\": true}} or {{\"restart\": true}}"}
    if data.get("stop") or data.get("restart"):
        (live.session.stopping if data.get("stop") else live.session.restarting).set()
        return None
    action = data.get("action")
    if not isinstance(action, str):
        return {"type": "error", "message": f"{NODE}: action is text, e.g. \"W+D\", not {type(action).__name__}"}
    try:
        seq, received = live.session.post(action)
    except FastARError as exc:
        return {"type": "error", "message": f"{NODE}: {exc}"}
    ident = data.get("id")
    return {"type": "ack", "seq": seq, "received": received,
            "id": ident if isinstance(ident, (int, float, str)) and len(str(ident)) <= 32 else None}


def register_routes(server) -> None:
    """The session's page and socket on ``server``'s route table (ComfyUI's PromptServer), once."""
    if server is None or getattr(server, "_fastar_play_routes", False):
        return
    from aiohttp import WSMsgType, web

    server._fastar_play_routes = True
    routes = server.routes
    refused = "FAST-AR World Play: no such session, or a wrong token"

    @routes.get("/fastar/play/{session}")
    async def page(request):
        if authorised(request) is None:
            return web.Response(status=403, text=refused)
        return web.Response(text=PAGE.read_text(), content_type="text/html")

    @routes.get("/fastar/play/{session}/ws")
    async def socket(request):
        live = authorised(request)
        if live is None or live.closed:
            return web.Response(status=403, text=refused)
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE)
        await ws.prepare(request)
        outbox = Outbox()
        live.pages.append(outbox)
        outbox.put(json.dumps(live.hello))
        live.connected.set()

        async def pump():
            while (message := await outbox.get()) is not _CLOSE:
                await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_str(message))
            await ws.close()
        sender = asyncio.ensure_future(pump())
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    answer = handle(live, msg.data)
                elif msg.type == WSMsgType.BINARY:
                    answer = {"type": "error", "message": f"{NODE}: the page sends JSON text, not binary"}
                else:
                    continue
                if answer is not None:
                    outbox.put(json.dumps(answer))
        finally:
            live.pages.remove(outbox)
            if not live.pages:  # the page closed: the session waits for it to come back
                live.connected.clear()
            if not sender.done():
                try:
                    await asyncio.wait_for(sender, 1.0) if live.closed else sender.cancel()
                except (asyncio.TimeoutError, ConnectionError):
                    pass
        return ws
