"""FAST-AR World Play: a world model played live from ComfyUI. Queued, the node opens a session and
tells the page that queued it where to play (``fastar.play``); the play page (``play_routes``) sends keys and
the mouse over the session's socket and gets the frames back as they are made. Each chunk takes the action
held when it starts (``fastar.play.Session``). With an Action Schedule connected the node plays it with no
page: a session's action log replays it frame for frame."""
from __future__ import annotations

import json
import logging
import time

import comfy.model_management
import comfy.utils
import torch
from comfy_api.latest import io, ui

from ..fastar import FastARError
from ..fastar.actions import FPS, MAX_TEXT, actions_text, parse_actions
from ..fastar.play import Session
from .matrix_game_nodes import HEIGHT, WIDTH, check_size, is_matrix_game, size_inputs
from .play_routes import NODE, Live, Shown, register_routes, sessions
from .play_worlds import MatrixGame, PackWorld, legend
from .progress import CacheEvents, prompt_server
from .schema import CacheType, StartType, check_widget, node_id, schema
from .world_nodes import CHUNK, ActionsType, Actions, WorldType, check_observe
from .words import in_words

PLAY_EVENT = "fastar.play"
PAGE_WAIT = 300.0  # seconds a session waits with no page open (or paused)
LOG_MARGIN = 128  # characters one more chunk can add to the log, at most


def _log(player, chunks: int) -> str:
    """The rows the first ``chunks`` chunks played (and the frames shown first) as action text."""
    return actions_text(player.table[:player.rows_played(chunks)], player.spec)


def _gpu() -> dict | None:
    """The GPU's memory in use and in all, for the page beside the cache's."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gb": torch.cuda.memory_allocated() / 1e9, "used_gb": (total - free) / 1e9,
            "total_gb": total / 1e9}


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
            rows, matrix_game = None, is_matrix_game(world)  # the world's kind, asked once
            if matrix_game:
                spec = world.variant.actions
            elif hasattr(world, "spec"):
                spec = world.spec.actions
                check_observe(cls, observe)
            else:
                raise FastARError(f"the world input is {type(world).__name__}: connect FAST-AR World Model or FAST-AR "
                                  f"Matrix-Game 2.0 Loader")
            if vae is not None and not matrix_game:
                raise FastARError("vae decodes Matrix-Game 2.0's frames; the pack's world decodes with its own "
                                  "decoder: disconnect vae")
            client = _client() if actions is None else None  # refused before any work
            # where chunks lie in the video (play_worlds.Layout): after the frames shown first, Matrix-Game's first short
            first, lead = (0, MatrixGame.lead) if matrix_game else (observe, 0)
            # the rollout as long as max_seconds (a replay's as its session's, so its numbers are the same)
            chunks = played = max(1, round(max_seconds * FPS) // CHUNK)
            if actions is not None:
                rows = parse_actions(actions.text, spec, CHUNK, actions.fps, first_chunk=CHUNK - lead)
                played = max(1, -(-(len(rows) - first + lead) // CHUNK))
                chunks = max(chunks, played)
            with torch.inference_mode():
                player = (MatrixGame(world, clip_vision_output, start, chunks, rows, (height, width), vae)
                          if matrix_game else PackWorld(world, image, observe, chunks, rows))
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
    hello = {"type": "hello", "world": player.name, "keys": legend(player.spec, player.words),
             "mouse": player.spec.mouse, "fps": FPS, "chunk": CHUNK, "size": list(player.size),
             "max_chunks": chunks, "first": player.first}
    live = Live(session, hello, server.loop)
    sessions[session.id] = live
    url = f"/fastar/play/{session.id}?token={session.token}"
    server.send_sync(PLAY_EVENT, {"node": unique, "session": session.id, "url": url, "world": player.name,
                                  "state": "open"}, client)
    logging.info("%s: session %s of %s is open; its page's address went to the client that queued it (the "
                 "node's button)", NODE, session.id, player.name)
    return live


def _play(cls, player, session: Session, cache, seed: int, chunks: int, client: tuple | None,
          page_wait: float = PAGE_WAIT) -> io.NodeOutput:
    """The rollout's first ``chunks`` chunks, as a loop over them: before each, the action held (live, for
    ``client``: the server and the client that queued it) or the schedule's is written into the chunk's
    rows; each one made is shown (``Shown``) while the next samples. A stop, a restart, the end of the
    length, a full log or no page for ``page_wait`` seconds end the loop between chunks."""
    unique, live = node_id(cls), client is not None
    link = _open(player, session, chunks, unique, *client) if live else None
    events = CacheEvents(unique)
    events.sampling(3, player.sampling.timesteps, player.sampling.shift, f"as {player.name} samples")
    pbar = comfy.utils.ProgressBar(chunks)
    shown = Shown(player, link, next(player.model.parameters()).device)

    def take(c: int) -> dict | None:
        if not live:
            return None
        taken = session.take()
        player.write_chunk(c, taken.row)
        return {"type": "chunk", "chunk": c, "seq": taken.seq, "taken": taken.taken, "received": taken.received}

    def wait() -> str | None:
        """Waits while no page is open or the session is paused, at most ``page_wait`` seconds (Cancel still
        ends it): no chunk is played unseen. Why the session ends, if it does."""
        if link.connected.is_set() and not session.paused.is_set():
            return None
        logging.info("%s: session %s %s (it ends after %g s)", NODE, session.id,
                     "is paused" if link.connected.is_set() else "waits for its page", page_wait)
        since = time.monotonic()
        while not link.connected.is_set() or session.paused.is_set():
            time.sleep(0.05)
            comfy.model_management.throw_exception_if_processing_interrupted()
            if session.stopping.is_set():
                return "stopped"
            if time.monotonic() - since > page_wait:
                reason = "paused" if link.connected.is_set() else "no page"
                logging.warning("%s: session %s ends: %s for %g s", NODE, session.id, reason, page_wait)
                return reason
        return None

    def gate(c: int) -> str | None:
        """Why the session ends (or restarts) before chunk ``c``, else None once it may play."""
        if session.stopping.is_set():
            return "stopped"
        if session.restarting.is_set():
            return "restart"
        if c == chunks:
            return "done"
        if live and c and len(_log(player, c)) > MAX_TEXT - LOG_MARGIN:
            return "log full"  # one more chunk could make a log no Action Schedule reads
        return wait() if live else None

    end, played = {"type": "end", "reason": "cancelled"}, 0
    try:
        with torch.inference_mode():  # the action rows are inference tensors, written between chunks
            while True:
                shown.begin()
                ro = player.rollout(cache, seed)
                events.start(ro.frames, chunks)
                rollout = ro.chunks(keep=False)
                played, reason = 0, gate(0)
                message = None if reason else take(0)
                while reason is None:
                    report = next(rollout)
                    played += 1
                    events(report)
                    pbar.update_absolute(played, chunks)
                    if message is not None:
                        message.update(latency_s=report.latency_s, cache=events.last, gpu=_gpu())
                    shown.put(report.latent, message)
                    if played == 1:
                        shown.handoff.drain()  # the first decode loads the decoder: nothing else runs meanwhile
                    comfy.model_management.throw_exception_if_processing_interrupted()
                    reason = gate(played)
                    message = None if reason else take(played)
                rollout.close()
                shown.handoff.drain()
                if reason != "restart":
                    end["reason"] = reason
                    break
                session.restarting.clear()
                player.reset()
                link.send(json.dumps({"type": "restart"}))
        shown.handoff.close()
    except BaseException:
        shown.handoff.close(raising=False)
        events.finish("stopped")
        raise
    finally:
        if live:
            sessions.pop(session.id, None)
            link.send(json.dumps({**end, "log": _log(player, played)}))
            link.close()
            client[0].send_sync(PLAY_EVENT, {"node": unique, "session": session.id, "state": "ended"}, client[1])
    events.finish("done")
    log = _log(player, played)
    return io.NodeOutput(torch.cat(shown.frames), log, Actions(log), ui=ui.PreviewText(log))


register_routes(prompt_server())
