"""How a rollout shows in ComfyUI: its progress bar with a preview of each chunk's last frame, and the
``fastar.cache`` events the cache widget (``web/fastar_cache.js``) draws."""
from __future__ import annotations

import importlib
import time

import comfy.utils

from ..fastar import video_frames

CACHE_EVENT = "fastar.cache"


def comfy_module(name: str):
    """A module of ComfyUI's top level: ``name`` in a checkout, ``comfy.cmd.name`` in the pip-installable
    ComfyUI."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return importlib.import_module(f"comfy.cmd.{name}")


class ChunkProgress:
    """ComfyUI progress bar per chunk, with a preview of the chunk's last frame: the latent previewer's,
    or the frame itself where the video is decoded as it comes (``stream``)."""

    def __init__(self, model, num_chunks: int, preview: bool):
        self.pbar = comfy.utils.ProgressBar(num_chunks)
        self.num_chunks = num_chunks
        self.previewer = None
        if preview:
            try:  # previews are best effort; never fail a run over one
                lp = comfy_module("latent_preview")
                self.previewer = lp.get_previewer(model.load_device, model.model.latent_format)
            except Exception:
                self.previewer = None

    def __call__(self, report, frame=None):
        image = None
        if frame is not None:  # [H, W, 3] in [0, 1]
            try:
                from PIL import Image

                lp = comfy_module("latent_preview")
                pixels = (frame * 255).clamp(0, 255).byte().cpu().numpy()
                image = ("JPEG", Image.fromarray(pixels), getattr(lp, "MAX_PREVIEW_RESOLUTION", 512))
            except Exception:
                image = None
        elif self.previewer is not None:
            try:
                image = self.previewer.decode_latent_to_preview_image("JPEG", report.latent[:, :, -1:])
            except Exception:
                image = None
        self.pbar.update_absolute(report.chunk + 1, self.num_chunks, image)


def prompt_server():
    """ComfyUI's PromptServer instance, or None outside a running server."""
    for name in ("server", "comfy.cmd.server"):
        try:
            module = __import__(name, fromlist=["PromptServer"])
            instance = getattr(module.PromptServer, "instance", None)
            if instance is not None:
                return instance
        except Exception:
            continue
    return None


def send_event(event: str, data: dict) -> None:
    server = prompt_server()
    if server is not None:
        server.send_sync(event, data, server.client_id)


class CacheEvents:
    """``fastar.cache`` events for the cache widget: plain numbers only (the widget formats them).
    ``video_of``: video frames of a count of latent frames (Wan's VAE by default; the pack's world
    stacks 4 video frames in every latent frame)."""

    def __init__(self, node, video_of=video_frames):
        self.node = None if node is None else str(node)
        self.video_of = video_of
        self.total, self.chunks, self.video_total = 0, 0, 0
        self.t0 = time.perf_counter()
        self.last = None
        self.engine_name, self.engine_reason = None, None
        self.prompts = 1
        self.files, self.frames_saved = None, None  # a video stream's (None: none)
        self.sampled = None  # how the chunks are sampled and where that came from (``sampling``)

    def _send(self, data: dict) -> None:
        send_event(CACHE_EVENT, {"node": self.node, "engine": self.engine_name, "engine_reason": self.engine_reason,
                                 "sampling": self.sampled, **data})

    def sampling(self, frames_per_chunk: int, timesteps, shift: float, source: str) -> None:
        """How the rollout samples (latent frames a chunk, steps, shift) and where that came from (the
        file, the widgets, the graph's sigmas): shown on the node, since a file's sampling overrides
        the widgets without changing them."""
        self.sampled = {"frames_per_chunk": int(frames_per_chunk), "timesteps": [float(t) for t in timesteps],
                        "shift": float(shift), "source": source}

    def start(self, total_frames: int, chunks: int, prompts: int = 1, length: int | None = None) -> None:
        """``total_frames`` latent frames in ``chunks`` chunks; ``length``: the video frames asked for,
        where whole chunks overshoot them and the latent is cut to them (default: all the chunks decode to)."""
        self.total, self.chunks, self.prompts, self.last = total_frames, chunks, prompts, None
        whole = self.video_of(total_frames)
        self.video_total = whole if length is None else min(length, whole)
        self.t0 = time.perf_counter()
        self._send({"status": "running", **self._frames(0, self.total), "chunk": 0,
                    "chunks": self.chunks, "prompt": 1, "prompts": prompts})

    def _frames(self, done: int, total: int) -> dict:
        """Frames done / total in latent frames (what the rollout counts) and in video frames (what
        ``length`` counts: the widget shows these)."""
        video_total = self.video_total if total == self.total else self.video_of(total)
        return {"frames_done": done, "total_frames": total,
                "video_frames_done": min(self.video_of(done), video_total), "video_total_frames": video_total}

    def engine(self, engine) -> None:
        self.engine_name, self.engine_reason = engine.name, engine.reason

    def __call__(self, r) -> None:
        s = r.cache
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.last = {
            "status": "running", "chunk": r.chunk + 1, "chunks": r.num_chunks,
            **self._frames(r.frames_done, r.total_frames),
            "tokens": s.tokens_held, "dense_tokens": s.dense_tokens, "capacity_tokens": s.capacity_tokens,
            "gb": s.gb, "held_gb": s.held_gb, "dense_gb": s.dense_gb, "host_gb": s.host_bytes / 1e9,
            "relative": (s.tokens_held / s.dense_tokens) if s.dense_tokens else 1.0,
            "latency_s": r.latency_s, "chunks_per_s": (r.chunk + 1) / elapsed,
            "annsa_density": r.annsa_density,  # None without AnnSA
            "annsa_sparse": r.annsa_sparse,    # share of AnnSA's layers that ran sparse; None without AnnSA
            "prompt": r.prompt + 1, "prompts": self.prompts,
            "video_files": self.files, "video_frames_saved": self.frames_saved,
        }
        self._send(self.last)

    def saved(self, files: list[str], frames: int) -> None:
        """The video stream's files and the frames written to each so far (shown with the next event)."""
        self.files, self.frames_saved = files, frames

    def finish(self, status: str) -> None:
        self._send({**(self.last or self._frames(0, self.total)), "status": status})

