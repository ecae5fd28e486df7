"""Prompts as the model's ``context``: ComfyUI CONDITIONING encoded as its samplers encode it, and a
FAST-AR Prompt Schedule as the chunks its prompts switch at, all at one token count."""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

import comfy.sampler_helpers
import comfy.samplers

from ..fastar import FastARError
from ..fastar.frames import chunk_first_frame, chunk_video_frames, first_chunk_from, video_frames, whole_chunks


def text_context(conds, batch: int, device, node: str, name: str) -> torch.Tensor:
    """The model's ``context`` [B, tokens, text_dim] of encoded conditioning (one prompt), or one clear error."""
    if not conds or len(conds) != 1:
        raise FastARError(f"{node}: the {name} conditioning must be one prompt (a single entry), got "
                          f"{len(conds or [])}; combined or area conditioning is not supported")
    model_conds = conds[0].get("model_conds", {})
    unsupported = sorted(k for k in model_conds if k != "c_crossattn")
    if unsupported:
        raise FastARError(f"{node}: the {name} conditioning carries {', '.join(unsupported)}, which the "
                          f"text-to-video autoregressive sampler does not use")
    if "c_crossattn" not in model_conds:
        raise FastARError(f"{node}: the {name} conditioning has no text embedding")
    return model_conds["c_crossattn"].process_cond(batch_size=batch, device=device).cond


def conditioning_context(model, conditioning, noise: torch.Tensor, device, node: str, name: str) -> torch.Tensor:
    """A ComfyUI CONDITIONING (one prompt) as the model's ``context``, encoded through the model's own
    ``extra_conds`` as ComfyUI's samplers encode it."""
    if not isinstance(conditioning, list):
        raise FastARError(f"{node}: the {name} input must be a CONDITIONING, got {type(conditioning).__name__}")
    conds = comfy.sampler_helpers.convert_cond(conditioning)
    conds = comfy.samplers.encode_model_conds(model.model.extra_conds, conds, noise, device, name)
    return text_context(conds, noise.shape[0], device, node, name)


def _match_tokens(*contexts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Repeat prompt embeddings to a common token count (attention over a sequence repeated n times
    equals attention over the sequence: the weights split evenly over the copies)."""
    n = math.lcm(*(c.shape[1] for c in contexts))
    return tuple(c if c.shape[1] == n else c.repeat(1, n // c.shape[1], 1) for c in contexts)


def schedule_chunks(starts: list[int], frames: int, chunk_frames: int, node: str, first: int = 0) -> list[int]:
    """The chunk each scheduled prompt after the first starts at: the first chunk all of whose video
    frames come at or after the prompt's start frame, so every frame before it keeps the earlier prompt.
    ``first``: latent frames before chunk 0 (a start image's)."""
    last_frame = video_frames(frames) - 1  # the last video frame of ``frames`` latent frames
    chunks, count = [], whole_chunks(frames - first, chunk_frames)
    for i, start in enumerate(starts[1:], 2):
        if start > last_frame:
            raise FastARError(f"{node}: FAST-AR Prompt Schedule's prompt {i} starts at frame {start}, past the "
                              f"video's end (its last frame is {last_frame})")
        chunk = first_chunk_from(start, chunk_frames, first)
        if chunk >= count:
            raise FastARError(f"{node}: FAST-AR Prompt Schedule's prompt {i} starts at frame {start}, inside the "
                              f"last chunk; the last a prompt can start at is frame "
                              f"{chunk_first_frame(count - 1, chunk_frames, first)}")
        if chunk == 0:
            raise FastARError(f"{node}: FAST-AR Prompt Schedule's prompt {i} starts at frame {start}, with the "
                              f"first chunk; start it at frame {chunk_first_frame(1, chunk_frames, first)} or later")
        if chunks and chunk == chunks[-1]:
            raise FastARError(f"{node}: FAST-AR Prompt Schedule's prompts {i - 1} and {i} both start with the "
                              f"chunk at frame {chunk_first_frame(chunk, chunk_frames, first)}: start them at least "
                              f"one chunk ({chunk_video_frames(chunk_frames)} frames) apart")
        chunks.append(chunk)
    return chunks


def scheduled_contexts(model, schedule, noise: torch.Tensor, device, frames: int, chunk_frames: int,
                       node: str, first: int = 0, positive: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """A FAST-AR Prompt Schedule as the rollout's first context and its (chunk, context) switches;
    logs where each prompt starts (a chunk's first frame, at or after the asked one). ``positive``: the
    first context where the schedule's first prompt is None (its prompt_1 unconnected)."""
    chunks = schedule_chunks([start for start, _ in schedule], frames, chunk_frames, node, first)
    contexts = [positive if cond is None else
                conditioning_context(model, cond, noise, device, node, f"prompt schedule's prompt {i}")
                for i, (_, cond) in enumerate(schedule, 1)]
    starts = "".join(f"; prompt {i} from frame {chunk_first_frame(c, chunk_frames, first)} (asked {start})"
                     for i, (c, (start, _)) in enumerate(zip(chunks, schedule[1:]), 2))
    logging.info("%s: the prompt schedule conditions the video%s", node, starts)
    return contexts[0], list(zip(chunks, contexts[1:]))


def prompt_contexts(patcher, prompts, positive, negative, encode: Callable, noise: torch.Tensor, device,
                    frames: int, chunk_frames: int, node: str, first: int = 0):
    """(first context, [(chunk, context)] prompt switches, negative context or None) at one token count.
    A prompt schedule conditions the video, from ``positive`` where its first prompt is None (prompt_1
    unconnected), else instead of it; ``encode(conditioning, name)`` turns
    the sampler's own positive / negative into a context. ``first``: latent frames before chunk 0."""
    switches = []
    if prompts:
        own = encode(positive, "positive") if prompts[0][1] is None else None  # prompt_1 unconnected
        context, switches = scheduled_contexts(patcher, prompts, noise, device, frames, chunk_frames, node, first,
                                               own)
    else:
        context = encode(positive, "positive")
    negative = None if negative is None else encode(negative, "negative")
    n = 1 + len(switches)
    texts = _match_tokens(context, *(t for _, t in switches), *([] if negative is None else [negative]))
    return texts[0], [(c, t) for (c, _), t in zip(switches, texts[1:n])], None if negative is None else texts[n]
