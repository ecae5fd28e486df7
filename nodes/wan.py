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


_noted_no_causal_class = False  # the note below, said once a server


def warn_if_not_causal(patcher, node: str) -> None:
    """A log warning where the model may not be a causal checkpoint (an autoregressive rollout of a
    bidirectional Wan 2.1 T2V model runs, but its video falls apart); where this ComfyUI cannot tell,
    a note once per server."""
    global _noted_no_causal_class
    causal = causal_checkpoint(patcher)
    if causal is False:
        logging.warning("%s: the model carries no causal metadata (ComfyUI loaded it as the bidirectional Wan 2.1 "
                        "WanModel): if it is a plain Wan 2.1 T2V file, chunk-by-chunk sampling gives a broken video; "
                        "the causal checkpoints (Causal-Forcing's ComfyUI files, or a .pt converted with "
                        "fastar convert) carry it", node)
    elif causal is None and not _noted_no_causal_class:
        _noted_no_causal_class = True
        logging.info("%s: this ComfyUI loads every Wan 2.1 T2V file as WanModel, so it cannot tell a causal "
                     "checkpoint from a plain T2V one; the video holds together only with a causal checkpoint "
                     "(Self-Forcing, CausVid, Causal-Forcing)", node)


def graph_model_file(prompt: dict | None, node, via: str = "model") -> str | None:
    """The file Load Diffusion Model read for the MODEL on ``node``'s input ``via``, in the prompt ComfyUI
    runs: followed back through the nodes that take a MODEL as their own ``model`` input and pass it on
    (FAST-AR Patch Model, LoRA loaders, model patches). None where the chain ends anywhere else (a
    checkpoint loader, a merge of two models) or outside a graph. Every ComfyUI has the prompt; only
    the 2026 trees also name the file on the model. Read while the node runs: a node whose output
    ComfyUI caches across a change of file must not keep it."""
    if not prompt or node is None or str(node) not in prompt:
        return None
    link, seen = prompt[str(node)].get("inputs", {}).get(via), set()
    while isinstance(link, list) and link and str(link[0]) not in seen:
        seen.add(str(link[0]))
        source = prompt.get(str(link[0]))
        if source is None:
            return None
        inputs = source.get("inputs", {})
        if source.get("class_type") == "UNETLoader":
            name = inputs.get("unet_name")
            return name if isinstance(name, str) else None
        link = inputs.get("model")
    return None


def _checkpoint_file(patcher, graph_file: str | None) -> tuple[str | None, str | None]:
    """(the model file's name, its path in diffusion_models or None): the name the graph's Load Diffusion
    Model was given (``graph_model_file``), else the one newer ComfyUIs put on the model (a base name,
    looked up where one file of that name is in diffusion_models)."""
    folder_paths = comfy_module("folder_paths")
    if graph_file:
        try:
            return graph_file, folder_paths.get_full_path("diffusion_models", graph_file)
        except KeyError:  # no such folder registered
            return graph_file, None
    name = getattr(patcher, "ckpt_name", None)
    if not name:
        return None, None
    try:
        found = [f for f in folder_paths.get_filename_list("diffusion_models") if os.path.basename(f) == name]
    except KeyError:
        return name, None
    return name, folder_paths.get_full_path("diffusion_models", found[0]) if len(found) == 1 else None


def unrecorded_reason(patcher, graph_file: str | None = None) -> str:
    """Why the sampler cannot take the MODEL's sampling from its file: said on the node, beside the
    sampling the widgets gave."""
    name, path = _checkpoint_file(patcher, graph_file)
    if name is None:
        return "the model does not come from one Load Diffusion Model file"
    if path is None:
        return f"{name} is not one file in diffusion_models"
    return f"{name} records no sampling (fastar convert --preset writes it)"


def recorded_sampling(patcher, graph_file: str | None = None):
    """(file name, the ``fastar.models.Sampling`` it records) for the MODEL's checkpoint file, or None where
    the file or its record is unknown. ``graph_file``: the file the graph loaded it from
    (``graph_model_file``)."""
    name, path = _checkpoint_file(patcher, graph_file)
    try:
        sampling = None if path is None else checkpoint_sampling(path)
    except FastARError:
        return None
    return None if sampling is None else (os.path.basename(name), sampling)


def check_sampling(patcher, chunk_frames: int, node: str, widget: str, schedule=None,
                   graph_file: str | None = None) -> None:
    """Refuse a block size other than the one the checkpoint file records (``fastar convert --preset``
    writes it), where the file is known; log where the sampler's steps or shift (``schedule``, a
    ``FlowMatchSchedule``) differ from the file's."""
    recorded = recorded_sampling(patcher, graph_file)
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
