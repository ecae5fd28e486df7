"""What a ComfyUI MODEL is, as FAST-AR needs to know it: a Wan 2.1 text-to-video DiT (recognised by its
parts, not its class), whether it was loaded as a causal checkpoint, and the dtype ComfyUI computes it in."""
from __future__ import annotations

import logging
import os

import torch

from ..fastar import FastARError
from ..fastar.models import checkpoint_sampling
from .progress import comfy_module

# The parts every Wan 2.1 T2V DiT ComfyUI builds has, under the names its checkpoints use: the stock
# ``WanModel`` and core's ``CausalWanModel`` (a plain ``nn.Module`` in one version, a ``WanModel``
# subclass in a later one) alike. Recognised by these, not by class name.
_WAN_PARTS = ("patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks", "head")
_WAN_BLOCK_PARTS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                    "cross_attn.v", "cross_attn.o", "ffn", "modulation")


def _has(module, dotted: str) -> bool:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def _is_wan_t2v(dm) -> bool:
    if dm is None or not all(_has(dm, p) for p in _WAN_PARTS) or len(dm.blocks) == 0:
        return False
    if not all(_has(dm.blocks[0], p) for p in _WAN_BLOCK_PARTS):
        return False
    # image-to-video, VACE, camera... variants carry more inputs than a text-to-video rollout feeds
    return getattr(dm, "model_type", "t2v") == "t2v" and getattr(dm, "img_emb", None) is None and \
        not hasattr(dm, "vace_blocks")


def wan_diffusion_model(model, node: str = "FAST-AR Patch Model"):
    """The Wan 2.1 T2V DiT inside a ComfyUI MODEL, or one clear error naming what it is."""
    base = getattr(model, "model", None)
    dm = getattr(base, "diffusion_model", None)
    what = type(dm).__name__ if dm is not None else type(base if base is not None else model).__name__
    family = type(base).__name__ if base is not None else type(model).__name__
    if not _is_wan_t2v(dm):
        detail = f"{family} / {what}"
        if getattr(dm, "model_type", "t2v") != "t2v":
            detail += f" (model_type={getattr(dm, 'model_type', '?')!r})"
        raise FastARError(f"{node}: the model input needs a Wan 2.1 text-to-video diffusion model (a causal Wan 2.1 "
                          f"checkpoint loaded with Load Diffusion Model); the MODEL connected is {detail}")
    if tuple(dm.patch_size)[0] != 1:
        raise FastARError(f"{node}: FAST-AR needs a temporal patch size of 1, the model has {tuple(dm.patch_size)}")
    return dm


def compute_dtype(patcher) -> torch.dtype:
    """The dtype ComfyUI computes the model in: its weights' dtype, or the one it casts them to."""
    return patcher.model.manual_cast_dtype or patcher.model.get_dtype()


def causal_checkpoint(patcher) -> bool | None:
    """Whether the MODEL was loaded as a causal checkpoint: True for core's causal Wan model (a file
    carrying the causal metadata ``fastar convert`` writes, on a ComfyUI with core's autoregressive
    nodes), False for the bidirectional WanModel on such a ComfyUI, None where this ComfyUI has no
    causal model class (every Wan 2.1 T2V file loads as WanModel, so nothing tells them apart)."""
    try:
        from comfy.ldm.wan.ar_model import CausalWanModel
    except ImportError:
        return None
    return isinstance(getattr(getattr(patcher, "model", None), "diffusion_model", None), CausalWanModel)


def warn_if_not_causal(patcher, node: str) -> None:
    """A log warning where the model may not be a causal checkpoint (an autoregressive rollout of a
    bidirectional Wan 2.1 T2V model runs, but its video falls apart)."""
    causal = causal_checkpoint(patcher)
    if causal is False:
        logging.warning("%s: the model carries no causal metadata (ComfyUI loaded it as the bidirectional Wan 2.1 "
                        "WanModel): if it is a plain Wan 2.1 T2V file, chunk-by-chunk sampling gives a broken video; "
                        "the causal checkpoints (Causal-Forcing's ComfyUI files, or a .pt converted with "
                        "fastar convert) carry it", node)
    elif causal is None:
        logging.info("%s: this ComfyUI loads every Wan 2.1 T2V file as WanModel, so it cannot tell a causal "
                     "checkpoint from a plain T2V one; the video holds together only with a causal checkpoint "
                     "(Self-Forcing, CausVid, Causal-Forcing)", node)


def _checkpoint_path(patcher) -> str | None:
    """The diffusion-model file the MODEL was loaded from, where this ComfyUI says (newer trees name it on
    the model, by its base name; 0.3.x keep no trace) and one file of that name is in diffusion_models."""
    name = getattr(patcher, "ckpt_name", None)
    if not name:
        return None
    folder_paths = comfy_module("folder_paths")
    try:
        found = [f for f in folder_paths.get_filename_list("diffusion_models") if os.path.basename(f) == name]
    except KeyError:  # no such folder registered
        return None
    return folder_paths.get_full_path("diffusion_models", found[0]) if len(found) == 1 else None


def recorded_sampling(patcher):
    """(file name, the ``fastar.models.Sampling`` it records) for the MODEL's checkpoint file, or None where
    the file or its record is unknown."""
    path = _checkpoint_path(patcher)
    try:
        sampling = None if path is None else checkpoint_sampling(path)
    except FastARError:
        return None
    return None if sampling is None else (os.path.basename(path), sampling)


def check_sampling(patcher, chunk_frames: int, node: str, widget: str, schedule=None) -> None:
    """Refuse a block size other than the one the checkpoint file records (``fastar convert --preset``
    writes it), where the file is known; log where the sampler's steps or shift (``schedule``, a
    ``FlowMatchSchedule``) differ from the file's."""
    recorded = recorded_sampling(patcher)
    if recorded is None:
        return
    name, sampling = recorded
    if sampling.frames_per_block != chunk_frames:
        raise FastARError(f"{node}: {widget} is {chunk_frames}, but {name} records {sampling.frames_per_block} "
                          f"latent frames per block ({sampling.describe()}); set {widget} to "
                          f"{sampling.frames_per_block}")
    if schedule is not None and sampling.schedule().sigmas() != schedule.sigmas():
        logging.warning("%s: %s records %s; the sampler's timesteps and shift differ from them", node, name,
                        sampling.describe())
