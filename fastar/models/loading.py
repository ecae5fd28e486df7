"""Build Wan models: random weights at a named size, or a ``.safetensors`` checkpoint.

Checkpoints are read with safetensors only (a pickle can run code; ``convert.py`` turns a training
checkpoint into one). Keys may carry the prefixes ComfyUI or training code put in front
(``model.diffusion_model.`` ...). The size is read off the tensor shapes; the head count, which shapes
cannot give, comes from the file's metadata when present, else Wan's head_dim of 128. A file's metadata
names what it is: a world model (``WorldModel``), Matrix-Game 2.0 (read off its keys too), plain Wan.
"""
from __future__ import annotations

import json
import os
import re

import torch

from ..errors import FastARError
from .checkpoints import CONFIG_METADATA_KEY, SAMPLING_METADATA_KEY, Sampling
from .wan import WAN_CONFIGS, WanConfig, WanModel
from .matrix_game import MatrixGameModel, detect
from .world import WORLD_METADATA_KEY, WorldConfig, WorldModel, WorldSpec

KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
SHAPE_KEYS = ("blocks.0.ffn.0.weight", "text_embedding.0.weight", "time_embedding.0.weight", "head.head.weight")


def build_model(config: str | WanConfig, *, device=None, dtype=torch.float32, seed: int = 0) -> WanModel:
    """A Wan model of a named size (``1.3B``, ``14B``, ``tiny``) with random weights."""
    if isinstance(config, str):
        if config not in WAN_CONFIGS:
            raise FastARError(f"unknown model size {config!r}; expected one of {', '.join(WAN_CONFIGS)}")
        config = WAN_CONFIGS[config]
    with torch.device("meta"):
        model = WanModel(config)
    model = model.to_empty(device=device or "cpu").to(dtype)
    return model.init_random(seed).eval().requires_grad_(False)


def strip_prefix(state_dict: dict) -> dict:
    for prefix in KEY_PREFIXES:
        if any(k.startswith(prefix + "blocks.") for k in state_dict):
            return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    return state_dict


def infer_config(state_dict: dict, num_heads: int | None = None) -> WanConfig:
    """Read a Wan 2.1 T2V config off a state dict's shapes."""
    if "patch_embedding.weight" not in state_dict or "blocks.0.self_attn.q.weight" not in state_dict:
        sample = ", ".join(sorted(state_dict)[:5])
        raise FastARError(f"not a Wan 2.1 diffusion model: no patch_embedding/blocks weights (keys: {sample} ...)")
    missing = [k for k in SHAPE_KEYS if k not in state_dict]
    if missing:
        raise FastARError(f"incomplete Wan 2.1 checkpoint: missing {', '.join(missing)}")
    if MATRIX_GAME_KEY in state_dict:
        raise FastARError("this is a Matrix-Game 2.0 world model: read it with fastar.models.matrix_game.detect "
                          "(load_wan and fastar convert --preset matrix-game-2 do)")
    if any(k.startswith("img_emb.") or ".k_img." in k for k in state_dict):
        raise FastARError("this is a Wan image-to-video checkpoint; autoregressive rollout needs a text-to-video "
                          "(causal) Wan 2.1 model")
    pe = state_dict["patch_embedding.weight"]  # [dim, in_dim, pt, ph, pw]
    dim, in_dim = pe.shape[:2]
    layers = 1 + max(int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k)))
    heads = num_heads or (dim // 128 if dim % 128 == 0 else None)
    if heads is None:
        raise FastARError(f"cannot tell the head count of a model with dim={dim} (not 128 a head): give it, "
                          f"fastar convert --num-heads N (num_heads=N in Python)")
    patch = tuple(pe.shape[2:])
    return WanConfig(
        dim=dim, num_heads=heads, num_layers=layers, in_dim=in_dim,
        ffn_dim=state_dict["blocks.0.ffn.0.weight"].shape[0],
        text_dim=state_dict["text_embedding.0.weight"].shape[1],
        freq_dim=state_dict["time_embedding.0.weight"].shape[1],
        out_dim=state_dict["head.head.weight"].shape[0] // (patch[0] * patch[1] * patch[2]),
        patch_size=patch,
        qk_norm="blocks.0.self_attn.norm_q.weight" in state_dict,
        cross_attn_norm="blocks.0.norm3.weight" in state_dict,
    )


def matching_model(state_dict: dict, config: WanConfig, name: str, world=None, actions=None,
                    variant=None) -> WanModel:
    """A meta-device Wan model (a ``WorldModel`` where ``world``, its ``WorldSpec``, is given; a
    ``MatrixGameModel`` where ``actions``, its ``ActionConfig``, is) whose parameter names are exactly
    ``state_dict``'s, or one clear error."""
    with torch.device("meta"):
        model = WorldModel(config, world) if world is not None else MatrixGameModel(config, actions, variant) \
            if actions is not None else WanModel(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise FastARError(f"{name} does not match a Wan 2.1 T2V model of dim {config.dim}: "
                          f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                          f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    return model


def load_wan(path: str | os.PathLike, *, device=None, dtype: torch.dtype | None = None,
             num_heads: int | None = None) -> WanModel:
    """Load a Wan 2.1 T2V / causal checkpoint from a ``.safetensors`` file (a world model, ``WorldModel``,
    where its metadata names its world)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FastARError(f"checkpoint not found: {path}")
    if not path.endswith(".safetensors"):
        raise FastARError(f"{os.path.basename(path)}: only .safetensors checkpoints are loaded "
                          "(pickled .pt/.ckpt files can run code); convert it first: fastar convert FILE.pt FILE.safetensors")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        state_dict = strip_prefix(load_file(path, device=str(device or "cpu")))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise FastARError(f"{os.path.basename(path)} is not a readable safetensors file: {exc}") from None
    world = actions = variant = None
    if MATRIX_GAME_KEY in state_dict:  # Matrix-Game 2.0, converted or as released: read off its keys
        config, actions, variant = detect(state_dict, num_heads or _metadata_heads(metadata))
    elif CONFIG_METADATA_KEY in metadata:
        recorded = json.loads(metadata[CONFIG_METADATA_KEY])
        kind = WorldConfig if WORLD_METADATA_KEY in metadata else WanConfig
        config = kind.from_dict(recorded)
    else:
        config = infer_config(state_dict, num_heads)
    if WORLD_METADATA_KEY in metadata:
        world = WorldSpec.from_json(metadata[WORLD_METADATA_KEY])
    model = matching_model(state_dict, config, os.path.basename(path), world, actions, variant)
    dtype = dtype or state_dict["blocks.0.self_attn.q.weight"].dtype
    model.load_state_dict(state_dict, assign=True)
    return model.to(dtype).eval().requires_grad_(False)


MATRIX_GAME_KEY = "blocks.0.action_model.keyboard_embed.0.weight"  # a Matrix-Game 2.0 file has it


def _metadata_heads(metadata: dict) -> int | None:
    """The head count a converted file's config records (None: none recorded)."""
    return json.loads(metadata[CONFIG_METADATA_KEY])["num_heads"] if CONFIG_METADATA_KEY in metadata else None


def save_wan(model: WanModel, path: str | os.PathLike) -> None:
    """Write a model as safetensors with its config in the metadata."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path),
              metadata={CONFIG_METADATA_KEY: json.dumps(model.config.to_dict())})


def checkpoint_sampling(path: str | os.PathLike) -> Sampling | None:
    """The sampling a converted ``.safetensors`` file records (frames per block, timesteps, shift), or None."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            text = (f.metadata() or {}).get(SAMPLING_METADATA_KEY)
    except Exception as exc:
        raise FastARError(f"{os.path.basename(os.fspath(path))} is not a readable safetensors file: {exc}") from None
    return None if text is None else Sampling.from_json(text)
