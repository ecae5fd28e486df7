"""FAST-AR World Play's protocol and routes on ComfyUI's server: ``GET /fastar/play/{session}`` the play
page (``web/fastar_play.html``) and ``GET /fastar/play/{session}/ws`` its socket, both refused without the
session's token. To the page: JSON (``hello``, then ``ack``, ``chunk``, ``paused``, ``restart``, ``end``,
``error``) and binary frames (a 4-byte big-endian frame number, then a JPEG): the frames shown first right
after ``hello`` (``hello.first`` of them), then each chunk's after its ``chunk`` message. From the page:
``{"action": "W+D", "id": n}``, ``{"pause": true|false}``, ``{"stop": true}`` and ``{"restart": true}``.
Every other message is answered with an ``error`` on a socket that stays open; the sockets close when their
session ends.

The token is the only key to a session: it goes to the client that queued it (``fastar.play``) and
nowhere else (not the log, not other clients)."""
from __future__ import annotations

import asyncio
import io as bytes_io
import json
import secrets
import struct
import threading
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ..fastar import FastARError
from ..fastar.play import Session
from ..fastar.handoff import Handoff

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
        self.start_frames: list[bytes] = []  # the frames shown first, for every page that opens
        self.connected = threading.Event()
        self.closed = False

    def send(self, message) -> None:
        """From any thread: to every page of the session (str: JSON text, bytes: a frame)."""
        self.loop.call_soon_threadsafe(lambda: [page.put(message) for page in self.pages])

    def open_page(self) -> Outbox:
        """On the server's loop: a page's outbox, its hello and the frames shown first already in it."""
        outbox = Outbox()
        self.pages.append(outbox)
        outbox.put(json.dumps({**self.hello, "paused": self.session.paused.is_set()}))
        for frame in self.start_frames:
            outbox.put(frame)
        self.connected.set()
        return outbox

    def show_first(self, frames: list[bytes]) -> None:
        """From any thread: the frames shown first, to the pages open now and to every page that opens later.
        Kept and sent in one step on the server's loop, so a page opening meanwhile gets them once."""
        def show():
            self.start_frames = frames
            for page in self.pages:
                for frame in frames:
                    page.put(frame)
        self.loop.call_soon_threadsafe(show)

    def close(self) -> None:
        """From any thread, after the last message: every page's socket closes once it has been sent."""
        def close():
            self.closed = True
            for page in self.pages:
                page.put(_CLOSE)
        self.loop.call_soon_threadsafe(close)


def _jpeg(frame: np.ndarray) -> bytes:
    from PIL import Image

    out = bytes_io.BytesIO()
    Image.fromarray(frame).save(out, format="JPEG", quality=85)
    return out.getvalue()


def _uint8(frames: torch.Tensor) -> np.ndarray:
    """Frames [n, H, W, 3] in [0, 1] as uint8."""
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


class Shown:
    """What a session shows: the frames shown first, then each chunk's decoded frames, kept for the node's
    output and sent to the pages as JPEGs (a 4-byte frame number first) after the chunk's message, each as
    soon as it is decoded; off the sampling thread (``Handoff``), so chunk k is decoded and sent while chunk
    k + 1 samples."""

    def __init__(self, player, link: Live | None, device):
        self.player, self.link, self.frames = player, link, []
        self.handoff = Handoff(self._show, device, name="fastar-world-play")

    def begin(self) -> None:
        """The frames shown first (the pack's world's observed frames), to every page now and later."""
        self.frames = [self.player.observed_frames()]
        if self.link is not None:
            self.link.show_first([struct.pack(">I", i) + _jpeg(f) for i, f in enumerate(_uint8(self.frames[0]))])

    def put(self, latent: torch.Tensor, message: dict | None) -> None:
        self.handoff.put(latent.clone(), message)  # the rollout reuses its buffers for the next chunk

    def _show(self, latent: torch.Tensor, message: dict | None) -> None:
        if self.link is None:
            self.frames.append(torch.cat(list(self.player.decode(latent))))
            return
        first, end = self.player.chunk_rows(message["chunk"])
        self.link.send(json.dumps({**message, "frames": [first, end - first]}))
        made, i = [], first
        for frames in self.player.decode(latent):  # each frame sent as it is decoded
            for f in _uint8(frames):
                self.link.send(struct.pack(">I", i) + _jpeg(f))
                i += 1
            made.append(frames)
        self.frames.append(torch.cat(made))


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
    if not isinstance(data, dict) or not ({"action", "pause", "stop", "restart"} & data.keys()):
        return {"type": "error", "message": f"{NODE}: a message from the page is a JSON object: "
                                           f"{{\"action\": \"W+D\"}}, {{\"pause\": true}}, {{\"stop\": true}} "
                                           f"or {{\"restart\": true}}"}
    if data.get("stop") or data.get("restart"):
        (live.session.stopping if data.get("stop") else live.session.restarting).set()
        return None
    if "pause" in data:
        (live.session.paused.set if data["pause"] is True else live.session.paused.clear)()
        live.send(json.dumps({"type": "paused", "paused": live.session.paused.is_set()}))  # to every page
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
        outbox = live.open_page()

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
