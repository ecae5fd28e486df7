"""FAST-AR World Play: a world model played live from ComfyUI. Queued, the node opens a session and
tells the page that queued it where to play (``fastar.play``); the play page (``web/fastar_play.html``,
served at ``/fastar/play/{session}``) sends keys and mouse over the session's websocket and gets the frames
back as they are made. Each chunk takes the action held when it starts (``fastar.play.Session``). With an
Action Schedule connected the node plays it with no page: a session's action log replays it frame for frame.

Routes (token-checked): ``GET /fastar/play/{session}`` the page, ``GET /fastar/play/{session}/ws`` its
socket. Messages to the page are JSON (``hello``, ``ack``, ``chunk``, ``end``, ``error``) and binary frames
(a 4-byte big-endian frame number, then a JPEG); from the page ``{"action": "W+D", "id": n}``, ``{"stop": true}``
and ``{"restart": true}``."""
from __future__ import annotations

import asyncio
import io as bytes_io
import json
import logging
import secrets
import struct
import threading
import time
from pathlib import Path

import comfy.latent_formats
import comfy.model_management
import comfy.utils
import numpy as np
import torch
from comfy_api.latest import io, ui

from ..fastar import FastARError, worlds
from ..fastar.play import Session
from .matrix_game_nodes import HEIGHT, WIDTH, _context, _is_matrix_game, split_rows, start_latent
from .progress import CacheEvents, prompt_server, send_event
from .schema import ADVANCED, CacheType, StartType, check_widget, node_id, schema
from .video import ChunkDecoder
from .world_nodes import CHUNK, ActionsType, Actions, WorldType, _photo
from .words import in_words

NODE = "FAST-AR World Play"
PLAY_EVENT = "fastar.play"
PAGE = Path(__file__).resolve().parent.parent / "web" / "fastar_play.html"
_sessions: dict[str, "Live"] = {}


class Stopped(Exception):
    """The player ended the session (stop message): the node returns what was played."""


class Restart(Exception):
    """The player asked for the world from its start again."""


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


def _authorised(request) -> Live | None:
    live = _sessions.get(request.match_info["session"])
    token = request.query.get("token", "")
    return live if live is not None and secrets.compare_digest(token.encode(), live.session.token.encode()) else None


def _register_routes() -> None:
    server = prompt_server()
    if server is None or getattr(server, "_fastar_play_routes", False):
        return
    from aiohttp import WSMsgType, web

    server._fastar_play_routes = True
    routes = server.routes

    @routes.get("/fastar/play/{session}")
    async def page(request):
        if _authorised(request) is None:
            return web.Response(status=403, text="FAST-AR World Play: no such session, or a wrong token")
        return web.Response(text=PAGE.read_text(), content_type="text/html")

    @routes.get("/fastar/play/{session}/ws")
    async def socket(request):
        live = _authorised(request)
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
        return ws


def _jpeg(frame: np.ndarray) -> bytes:
    from PIL import Image

    out = bytes_io.BytesIO()
    Image.fromarray(frame).save(out, format="JPEG", quality=85)
    return out.getvalue()


def _uint8(frames: torch.Tensor) -> np.ndarray:
    """Frames [n, H, W, 3] in [0, 1] as uint8."""
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


def _table(spec: worlds.ActionSpec, n: int, rows: np.ndarray | None) -> np.ndarray:
    """A session's action rows [n, width]: a schedule's (``rows``, the rest idle), or idle to be written live."""
    table = np.repeat(worlds.parse_actions("idle", spec, 1), n, 0)
    if rows is not None:
        table[:min(n, len(rows))] = rows[:n]
    return table


class _PackWorld:
    """The pack's world over a photograph: the camera starts at its centre and is shown ``observe`` frames
    of the truth there (the log's first rows), then the model makes each chunk."""

    def __init__(self, model, image, observe: int, chunks: int, rows: np.ndarray | None):
        from ..fastar.models.world import WORLD_SAMPLING

        spec = model.spec
        self.spec, self.name, self.size = spec.actions, "the pack's world", (spec.view, spec.view)
        photo = _photo(image)
        if min(photo.shape[1:]) < spec.view:
            raise FastARError(f"the image is {photo.shape[2]}x{photo.shape[1]} px; the camera's view is {spec.view} "
                              f"px, the image must be at least that on each side")
        device = next(model.parameters()).device
        n = observe + chunks * CHUNK
        self.table = _table(spec.actions, n, rows)
        self.rows = torch.from_numpy(self.table)[None].to(device, model.dtype)  # the context's rows, written live
        centre = torch.tensor([photo.shape[2] / 2, photo.shape[1] / 2, 0.0])
        poses = worlds.integrate(torch.from_numpy(self.table[:observe]), spec.actions, centre)
        truth = worlds.render(photo.to(device), poses.to(device), spec.view).transpose(0, 1)[None]
        self.first = observe
        self.observed = truth
        self.model, self.world = model, spec
        self.sampling = WORLD_SAMPLING
        self.start = spec.encode(truth).to(model.dtype)
        self.context = self.rows.view(1, n // spec.frames_per_latent, -1)

    def reset(self) -> None:
        """Every action after the frames shown first back to idle: the session from its start."""
        self.write(self.first, len(self.table) - self.first, self.table[0])

    def rollout(self, cache, seed):
        from ..fastar import Rollout

        return Rollout(self.model, self.context, frames=self.context.shape[1], height=self.size[0],
                       width=self.size[1], chunk_frames=self.sampling.frames_per_block,
                       schedule=self.sampling.schedule(), cache=cache, seed=seed, start=self.start)

    def write(self, first: int, count: int, row: np.ndarray) -> None:
        self.table[first:first + count] = row
        self.rows[0, first:first + count] = torch.from_numpy(row).to(self.rows)

    def observed_frames(self) -> torch.Tensor:
        return ((self.observed[0].permute(1, 2, 3, 0) + 1) / 2).float().cpu()

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return ((self.world.decode(x0.float())[0].permute(1, 2, 3, 0) + 1) / 2).cpu()


class _MatrixGame:
    """Matrix-Game 2.0 from a start image: chunks of 12 video frames' actions (the first makes 9 frames)."""

    def __init__(self, model, clip_vision_output, start, chunks: int, rows: np.ndarray | None,
                 size: tuple[int, int]):
        if clip_vision_output is None or start is None:
            raise FastARError("a Matrix-Game 2.0 world starts from an image: connect clip_vision_output (CLIP Vision "
                              "Encode, crop none) and start (FAST-AR Start Image)")
        variant = model.variant
        if variant.sampling is None:
            raise FastARError(f"the {variant.name} model records no sampling: play a distilled variant")
        self.spec, self.name, self.size = variant.actions, f"Matrix-Game 2.0 {variant.name}", size
        self.model, self.sampling, self.first = model, variant.sampling, 0
        self.table = _table(self.spec, chunks * CHUNK, rows)
        self.keyboard, self.mouse = split_rows(torch.from_numpy(self.table).clone(), model)
        frames = 3 * chunks
        device = next(model.parameters()).device
        self.context = _context(clip_vision_output, model).to(device, model.dtype)
        self.condition = start_latent(start, frames, size[1], size[0], NODE).to(device)
        self.vae, self.format = start.vae, comfy.latent_formats.Wan21()
        self.decoder = ChunkDecoder(self.vae, NODE)
        self.frames = frames

    def reset(self) -> None:
        """Every action back to idle, the decoder's cache empty: the session from its start."""
        self.write(0, len(self.table), worlds.parse_actions("idle", self.spec, 1)[0])
        self.decoder = ChunkDecoder(self.vae, NODE)

    def rollout(self, cache, seed):
        from ..fastar import Rollout

        run = self.model.bind(self.condition, self.keyboard, self.mouse, frames=self.frames)
        return Rollout(run, self.context, frames=self.frames, height=self.size[0], width=self.size[1],
                       chunk_frames=3, schedule=self.sampling.schedule(), cache=cache, seed=seed)

    def write(self, first: int, count: int, row: np.ndarray) -> None:
        self.table[first:first + count] = row
        keys = len(self.model.variant.keys)
        self.keyboard[0, first:first + count] = torch.from_numpy(row[:keys]).to(self.keyboard)
        if self.mouse is not None:
            self.mouse[0, first:first + count] = torch.from_numpy(row[keys:]).to(self.mouse)

    def observed_frames(self) -> torch.Tensor:
        return torch.zeros(0, *self.size, 3)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(self.decoder(self.format.process_out(x0.float()))))


def _log(player, chunks: int) -> str:
    """The rows the first ``chunks`` chunks played (and the frames shown first) as action text."""
    return worlds.actions_text(player.table[:player.first + chunks * CHUNK], player.spec)


def legend(spec: worlds.ActionSpec) -> list[list[str]]:
    """The page's keys: (what to press, the action it sends)."""
    keyboard = {"W": "W", "S": "S", "A": "A", "D": "D", "forward": "W", "back": "S", "jump": "Space",
                "slide": "C", "turnleft": "Q", "turnright": "E", "leftside": "A", "rightside": "D",
                "zoom_in": "Z", "zoom_out": "X"}
    out = [[keyboard.get(k, k), k] for k in spec.keys if k not in spec.idle]
    out += [[keyboard[a], a] for a, _ in spec.aliases if a in keyboard and a not in dict(out).values()]
    if spec.mouse:
        out.append(["mouse", "look"])
    return out


class WorldPlay(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARWorldPlay",
            display_name=NODE,
            description="Plays a world model live: queued, it opens a session and a play page (the node's button, "
                        "or the link in the log) where keys and the mouse steer it and its frames come back as "
                        "they are made; each chunk takes the action held when it starts. Stop on the page (or "
                        "the length running out) returns the frames played and the action log, an Action Schedule "
                        "that replays the session frame for frame with this node and the same seed. With actions "
                        "connected it plays them with no page. The pack's world (no download, the CPU is enough) "
                        "or Matrix-Game 2.0 (a GPU; connect clip_vision_output and start).",
            inputs=[
                WorldType.Input("world", tooltip="FAST-AR World Model, or FAST-AR Matrix-Game 2.0 Loader."),
                io.Int.Input("seed", default=0, min=0, max=2 ** 31 - 1, control_after_generate=True,
                             tooltip="The noise of every chunk: a session replays with the seed it ran with."),
                io.Float.Input("max_seconds", default=60.0, min=1.0, max=3600.0, step=1.0,
                               tooltip="The longest session, at 16 video frames a second: it ends there."),
                CacheType.Input("cache", optional=True,
                                tooltip="TempCache Settings or Sink + Window Cache. Empty: TempCache at its defaults."),
                ActionsType.Input("actions", optional=True,
                                  tooltip="An Action Schedule (a session's log): played with no page, frame for "
                                          "frame as the session was."),
                io.Image.Input("image", optional=True, tooltip="The pack's world: the photograph (empty: the pack's)."),
                io.Int.Input("observe", default=12, min=CHUNK, max=1200, step=CHUNK, optional=True,
                             tooltip="The pack's world: video frames of the photograph shown first."),
                io.ClipVisionOutput.Input("clip_vision_output", optional=True,
                                          tooltip="Matrix-Game 2.0: CLIP Vision Encode (crop none) of the start image."),
                StartType.Input("start", optional=True, tooltip="Matrix-Game 2.0: FAST-AR Start Image."),
                io.Int.Input("width", default=WIDTH, min=16, max=4096, step=16, optional=True, **ADVANCED,
                             tooltip="Matrix-Game 2.0: pixels; it is trained at 640 x 352."),
                io.Int.Input("height", default=HEIGHT, min=16, max=4096, step=16, optional=True, **ADVANCED,
                             tooltip="Matrix-Game 2.0: pixels; it is trained at 640 x 352."),
            ],
            outputs=[io.Image.Output("frames"), io.String.Output("action_log"), ActionsType.Output("schedule")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, world, seed, max_seconds, cache=None, actions=None, image=None, observe=12,
                clip_vision_output=None, start=None, width=WIDTH, height=HEIGHT) -> io.NodeOutput:
        with in_words(NODE):
            check_widget(cls, "max_seconds", max_seconds)
            for name, value in (("width", width), ("height", height)):
                check_widget(cls, name, value)
                if value % 16:
                    raise FastARError(f"{name} {value} is not a multiple of 16 pixels")
            rows = None
            if _is_matrix_game(world):
                spec = world.variant.actions
            elif hasattr(world, "spec"):
                spec = world.spec.actions
                check_widget(cls, "observe", observe)
                if observe % CHUNK:
                    raise FastARError(f"observe {observe} must be a multiple of {CHUNK} video frames")
            else:
                raise FastARError(f"the world input is {type(world).__name__}: connect FAST-AR World Model or FAST-AR "
                                  f"Matrix-Game 2.0 Loader")
            first = observe if not _is_matrix_game(world) else 0
            # the rollout as long as max_seconds (a replay's as its session's, so its numbers are the same)
            chunks = played = max(1, round(max_seconds * worlds.FPS) // CHUNK)
            if actions is not None:
                rows = worlds.parse_actions(actions.text, spec, CHUNK, actions.fps)
                played = -(-max(len(rows) - first, 1) // CHUNK)
                chunks = max(chunks, played)
            with torch.inference_mode():
                player = (_MatrixGame(world, clip_vision_output, start, chunks, rows, (height, width))
                          if _is_matrix_game(world)
                          else _PackWorld(world, image, observe, chunks, rows))
            session = Session(spec)
            return _play(cls, player, session, cache, int(seed), played, live=actions is None)


def _play(cls, player, session: Session, cache, seed: int, chunks: int, live: bool) -> io.NodeOutput:
    """The rollout's first ``chunks`` chunks: before each, the action held (live) or the schedule's is
    written into the model's action rows; after each, its frames are decoded and sent."""
    server, unique = prompt_server(), node_id(cls)
    live_end = None
    if live:
        if server is None:
            raise FastARError("a live session needs ComfyUI's server: connect an Action Schedule to play one offline")
        hello = {"type": "hello", "world": player.name, "keys": legend(player.spec), "mouse": player.spec.mouse,
                 "fps": worlds.FPS, "chunk": CHUNK, "size": list(player.size), "max_chunks": chunks}
        live_end = Live(session, hello, server.loop)
        _sessions[session.id] = live_end
        url = f"/fastar/play/{session.id}?token={session.token}"
        send_event(PLAY_EVENT, {"node": unique, "session": session.id, "url": url, "world": player.name})
        logging.info("%s: a session of %s is open: play it at %s", NODE, player.name, url)
    played = [player.observed_frames()]
    events = CacheEvents(unique)
    events.sampling(3, player.sampling.timesteps, player.sampling.shift, f"as {player.name} samples")
    pbar = comfy.utils.ProgressBar(chunks)
    frame_no = sum(len(p) for p in played)
    reason = "done"

    done = 0  # chunks played

    def take(c: int) -> dict:
        if not live:
            return {}
        taken = session.take()
        player.write(player.first + c * CHUNK, CHUNK, taken.row)
        return {"type": "chunk", "chunk": c, "seq": taken.seq, "taken": taken.taken, "received": taken.received}

    def on_chunk(report):
        nonlocal frame_no, info, done
        done += 1
        frames = player.decode(report.latent)
        played.append(frames)
        events(report)
        pbar.update_absolute(report.chunk + 1, chunks)
        if live:
            live_end.send(json.dumps({**info, "frames": [frame_no, len(frames)], "latency_s": report.latency_s,
                                      "cache": events.last}))
            for i, f in enumerate(_uint8(frames)):
                live_end.send(struct.pack(">I", frame_no + i) + _jpeg(f))
        frame_no += len(frames)
        comfy.model_management.throw_exception_if_processing_interrupted()
        if session.stopping.is_set():
            raise Stopped
        if session.restarting.is_set():
            raise Restart
        if report.chunk + 1 == chunks:
            raise Stopped
        info = take(report.chunk + 1)

    try:
        while live and not live_end.connected.wait(0.05):  # the page first: no chunk is played unseen
            comfy.model_management.throw_exception_if_processing_interrupted()
        with torch.inference_mode():  # the action rows are inference tensors, written between chunks
            while True:
                ro = player.rollout(cache, seed)
                events.start(ro.frames, chunks)
                info = take(0)
                try:
                    ro.run(on_chunk, keep=False)
                    break
                except Restart:
                    session.restarting.clear()
                    player.reset()
                    played, done = [player.observed_frames()], 0
                    frame_no = len(played[0])
                    live_end.send(json.dumps({"type": "restart"}))
    except Stopped:
        reason = "stopped" if session.stopping.is_set() else "done"
    except BaseException:
        events.finish("stopped")
        if live:
            live_end.send(json.dumps({"type": "end", "reason": "cancelled", "log": _log(player, done)}))
        raise
    finally:
        if live:
            _sessions.pop(session.id, None)
    events.finish("done")
    log = _log(player, done)
    if live:
        live_end.send(json.dumps({"type": "end", "reason": reason, "log": log, "time": time.perf_counter()}))
    frames = torch.cat(played)
    return io.NodeOutput(frames, log, Actions(log), ui=ui.PreviewText(log))


_register_routes()
