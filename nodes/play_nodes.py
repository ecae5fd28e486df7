"""FAST-AR World Play: a world model played live from ComfyUI. Queued, the node opens a session and
tells the page that queued it where to play (``fastar.play``); the play page (``play_routes``) sends keys and
the mouse over the session's socket and gets the frames back as they are made. Each chunk takes the action
held when it starts (``fastar.play.Session``). With an Action Schedule connected the node plays it with no
page: a session's action log replays it frame for frame."""
from __future__ import annotations

import io as bytes_io
import json
import logging
import struct
import time

import comfy.model_management
import comfy.utils
import numpy as np
import torch
from comfy_api.latest import io, ui

from ..fastar import FastARError
from ..fastar.actions import FPS, MAX_TEXT, actions_text, parse_actions
from ..fastar.play import Session
from .matrix_game_nodes import HEIGHT, WIDTH, check_size, is_matrix_game, size_inputs
from .play_routes import NODE, Live, register_routes, sessions
from .players import MatrixGame, PackWorld, legend
from .progress import CacheEvents, prompt_server
from .schema import CacheType, StartType, check_widget, node_id, schema
from .world_nodes import CHUNK, ActionsType, Actions, WorldType
from .words import in_words

PLAY_EVENT = "fastar.play"
PAGE_WAIT = 300.0  # seconds a session waits with no page open
LOG_MARGIN = 128  # characters one more chunk can add to the log, at most


class Stopped(Exception):
    """The session ends here (stop message, its length, no page, a full log): the node returns what was
    played."""

    def __init__(self, reason: str = "done"):
        super().__init__(reason)
        self.reason = reason


class Restart(Exception):
    """The player asked for the world from its start again."""


def _jpeg(frame: np.ndarray) -> bytes:
    from PIL import Image

    out = bytes_io.BytesIO()
    Image.fromarray(frame).save(out, format="JPEG", quality=85)
    return out.getvalue()


def _uint8(frames: torch.Tensor) -> np.ndarray:
    """Frames [n, H, W, 3] in [0, 1] as uint8."""
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


def _log(player, chunks: int) -> str:
    """The rows the first ``chunks`` chunks played (and the frames shown first) as action text."""
    return actions_text(player.table[:player.first + chunks * CHUNK], player.spec)


class WorldPlay(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARWorldPlay",
            display_name=NODE,
            description="Plays a world model live: queued, it opens a session and a play page (the node's button, "
                        "or the link in the log) where keys and the mouse steer it and its frames come back as "
                        "they are made; each chunk takes the action held when it starts, and with no page open it "
                        "waits. Stop on the page (or "
                        "the length running out) returns the frames played and the action log, an Action Schedule "
                        "that replays the session frame for frame with this node and the same seed. With actions "
                        "connected it plays them with no page. The pack's world (no download, the CPU is enough) "
                        "or Matrix-Game 2.0 (a GPU; connect clip_vision_output and start).",
            inputs=[
                WorldType.Input("world", tooltip="FAST-AR World Model, or FAST-AR Matrix-Game 2.0 Loader."),
                io.Int.Input("seed", default=0, min=0, max=2 ** 31 - 1, control_after_generate=True,
                             tooltip="The noise of every chunk: a session replays with the seed it ran with."),
                io.Float.Input("max_seconds", default=60.0, min=1.0, max=3600.0, step=1.0,
                               tooltip="The longest session, at 16 video frames a second: it ends there. Its "
                                       "frames are kept for the frames output (Matrix-Game 2.0 at 640 x 352: "
                                       "2.6 GB a minute)."),
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
                io.Vae.Input("vae", optional=True,
                             tooltip="Matrix-Game 2.0: what decodes the frames. A fast decoder (FAST-AR Load Fast "
                                     "Decoder with taew2_1, or Load VAE's lighttaew2_1) plays faster; empty: the "
                                     "start image's Wan VAE."),
                *size_inputs("Matrix-Game 2.0: "),
                io.Float.Input("page_wait", default=PAGE_WAIT, min=10.0, max=3600.0, step=10.0, optional=True,
                               tooltip="Seconds a live session waits while no play page is open (before the "
                                       "first chunk, or after its page closed) before it ends with what it "
                                       "played: a forgotten session does not hold ComfyUI's queue."),
            ],
            outputs=[io.Image.Output("frames"), io.String.Output("action_log"), ActionsType.Output("schedule")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, actions=None, **_):
        """A live session is a new one each time it is queued (never ComfyUI's cached outputs); a schedule
        played offline is its inputs'."""
        return float("nan") if actions is None else ""

    @classmethod
    def execute(cls, world, seed, max_seconds, cache=None, actions=None, image=None, observe=12,
                clip_vision_output=None, start=None, vae=None, width=WIDTH, height=HEIGHT,
                page_wait=PAGE_WAIT) -> io.NodeOutput:
        with in_words(NODE):
            check_widget(cls, "max_seconds", max_seconds)
            check_widget(cls, "page_wait", page_wait)
            check_size(cls, width, height)
            rows = None
            if is_matrix_game(world):
                spec = world.variant.actions
            elif hasattr(world, "spec"):
                spec = world.spec.actions
                check_widget(cls, "observe", observe)
                if observe % CHUNK:
                    raise FastARError(f"observe {observe} must be a multiple of {CHUNK} video frames")
            else:
                raise FastARError(f"the world input is {type(world).__name__}: connect FAST-AR World Model or FAST-AR "
                                  f"Matrix-Game 2.0 Loader")
            if vae is not None and not is_matrix_game(world):
                raise FastARError("vae decodes Matrix-Game 2.0's frames; the pack's world decodes with its own "
                                  "decoder: disconnect vae")
            client = _client() if actions is None else None  # refused before any work
            first = observe if not is_matrix_game(world) else 0
            # the rollout as long as max_seconds (a replay's as its session's, so its numbers are the same)
            chunks = played = max(1, round(max_seconds * FPS) // CHUNK)
            if actions is not None:
                rows = parse_actions(actions.text, spec, CHUNK, actions.fps)
                played = -(-max(len(rows) - first, 1) // CHUNK)
                chunks = max(chunks, played)
            with torch.inference_mode():
                player = (MatrixGame(world, clip_vision_output, start, chunks, rows, (height, width), vae)
                          if is_matrix_game(world)
                          else PackWorld(world, image, observe, chunks, rows))
            session = Session(spec)
            return _play(cls, player, session, cache, int(seed), played, client, page_wait=float(page_wait))


def _client() -> tuple:
    """ComfyUI's server and the client that queued this prompt: a live session's page goes to it alone."""
    server = prompt_server()
    if server is None:
        raise FastARError("a live session needs ComfyUI's server: connect an Action Schedule to play one offline")
    client = getattr(server, "client_id", None)
    if client is None:
        raise FastARError("a live session's page goes to the client that queued it, and this prompt names none: "
                          "queue it from ComfyUI's page, or pass client_id with /prompt (and listen on /ws with "
                          "that clientId); or connect an Action Schedule to play offline")
    return server, client


def _open(player, session: Session, chunks: int, unique, server, client) -> Live:
    """A live session's routes and its page's address, sent to the client that queued it only (its
    token is the session's one key: never in the log, never to other clients)."""
    hello = {"type": "hello", "world": player.name, "keys": legend(player.spec), "mouse": player.spec.mouse,
             "fps": FPS, "chunk": CHUNK, "size": list(player.size), "max_chunks": chunks}
    live = Live(session, hello, server.loop)
    sessions[session.id] = live
    url = f"/fastar/play/{session.id}?token={session.token}"
    server.send_sync(PLAY_EVENT, {"node": unique, "session": session.id, "url": url, "world": player.name}, client)
    logging.info("%s: session %s of %s is open; its page's address went to the client that queued it (the "
                 "node's button)", NODE, session.id, player.name)
    return live


def _play(cls, player, session: Session, cache, seed: int, chunks: int, client: tuple | None,
          page_wait: float = PAGE_WAIT) -> io.NodeOutput:
    """The rollout's first ``chunks`` chunks: before each, the action held (live, for ``client``: the server
    and the client that queued it) or the schedule's is written into the model's action rows; after each,
    its frames are decoded and sent."""
    unique, live = node_id(cls), client is not None
    link = _open(player, session, chunks, unique, *client) if live else None
    played = [player.observed_frames()]  # the frames shown first, then each chunk's
    events = CacheEvents(unique)
    events.sampling(3, player.sampling.timesteps, player.sampling.shift, f"as {player.name} samples")
    pbar = comfy.utils.ProgressBar(chunks)
    end = {"type": "end", "reason": "done"}

    def take(c: int) -> dict:
        if not live:
            return {}
        taken = session.take()
        player.write(player.first + c * CHUNK, CHUNK, taken.row)
        return {"type": "chunk", "chunk": c, "seq": taken.seq, "taken": taken.taken, "received": taken.received}

    def wait_for_page():
        """No chunk is played unseen: the session waits while no page is open, at most ``page_wait``
        seconds (Cancel still ends it)."""
        if link.connected.is_set():
            return
        logging.info("%s: session %s waits for its page (it ends after %g s without one)", NODE, session.id,
                     page_wait)
        since = time.monotonic()
        while not link.connected.wait(0.05):
            comfy.model_management.throw_exception_if_processing_interrupted()
            if time.monotonic() - since > page_wait:
                logging.warning("%s: session %s ends: no page open for %g s", NODE, session.id, page_wait)
                raise Stopped("no page")

    def on_chunk(report):
        nonlocal info
        first = sum(len(p) for p in played)  # this chunk's first frame's number
        frames = player.decode(report.latent)
        played.append(frames)
        events(report)
        pbar.update_absolute(report.chunk + 1, chunks)
        if live:
            link.send(json.dumps({**info, "frames": [first, len(frames)], "latency_s": report.latency_s,
                                  "cache": events.last}))
            for i, f in enumerate(_uint8(frames)):
                link.send(struct.pack(">I", first + i) + _jpeg(f))
        comfy.model_management.throw_exception_if_processing_interrupted()
        if session.stopping.is_set():
            raise Stopped("stopped")
        if session.restarting.is_set():
            raise Restart
        if report.chunk + 1 == chunks:
            raise Stopped("done")
        if live:
            if len(_log(player, len(played) - 1)) > MAX_TEXT - LOG_MARGIN:
                raise Stopped("log full")  # one more chunk could make a log no Action Schedule reads
            wait_for_page()
        info = take(report.chunk + 1)

    try:
        if live:
            wait_for_page()
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
                    played = [player.observed_frames()]
                    link.send(json.dumps({"type": "restart"}))
    except Stopped as stop:
        end["reason"] = stop.reason
    except BaseException:
        end["reason"] = "cancelled"
        events.finish("stopped")
        raise
    finally:
        if live:
            sessions.pop(session.id, None)
            link.send(json.dumps({**end, "log": _log(player, len(played) - 1)}))
            link.close()
    events.finish("done")
    log = _log(player, len(played) - 1)
    frames = torch.cat(played)
    return io.NodeOutput(frames, log, Actions(log), ui=ui.PreviewText(log))


register_routes(prompt_server())
