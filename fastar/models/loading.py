"""Build Wan models: random weights at a named size, or a ``.safetensors`` checkpoint.

Checkpoints are read with safetensors only (a pickle can run code). Keys may carry the
prefixes ComfyUI or training code put in front (``model.diffusion_model.`` ...). The size is
read off the tensor shapes; the head count, which shapes cannot give, comes from the file's
metadata when present, else Wan's head_dim of 128.
"""
from __future__ import annotations

import json
import os
import re

import torch

from ..errors import FastARError
from .wan import WAN_CONFIGS, WanConfig, WanModel

KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
CONFIG_METADATA_KEY = "fastar.wan_config"
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
    if any(k.startswith("img_emb.") or ".k_img." in k for k in state_dict):
        raise FastARError("this is a Wan image-to-video checkpoint; autoregressive rollout needs a text-to-video "
                          "(causal) Wan 2.1 model")
    pe = state_dict["patch_embedding.weight"]  # [dim, in_dim, pt, ph, pw]
    dim, in_dim = pe.shape[:2]
    layers = 1 + max(int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k)))
    heads = num_heads or (dim // 128 if dim % 128 == 0 else None)
    if heads is None:
        raise FastARError(f"cannot tell the head count of a model with dim={dim}; pass num_heads")
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


def load_wan(path: str | os.PathLike, *, device=None, dtype: torch.dtype | None = None,
             num_heads: int | None = None) -> WanModel:
    """Load a Wan 2.1 T2V / causal checkpoint from a ``.safetensors`` file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FastARError(f"checkpoint not found: {path}")
    if not path.endswith(".safetensors"):
        raise FastARError(f"{os.path.basename(path)}: only .safetensors checkpoints are loaded "
                          "(pickled .pt/.ckpt files can run code); convert it to safetensors first")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        state_dict = strip_prefix(load_file(path, device=str(device or "cpu")))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise FastARError(f"{os.path.basename(path)} is not a readable safetensors file: {exc}") from None
    if CONFIG_METADATA_KEY in metadata:
        config = WanConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in json.loads(metadata[CONFIG_METADATA_KEY]).items()})
    else:
        config = infer_config(state_dict, num_heads)
    with torch.device("meta"):
        model = WanModel(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise FastARError(f"{os.path.basename(path)} does not match a Wan 2.1 T2V model of dim {config.dim}: "
                          f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                          f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    dtype = dtype or state_dict["blocks.0.self_attn.q.weight"].dtype
    model.load_state_dict(state_dict, assign=True)
    return model.to(dtype).eval().requires_grad_(False)


def save_wan(model: WanModel, path: str | os.PathLike) -> None:
    """Write a model as safetensors with its config in the metadata."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path),
              metadata={CONFIG_METADATA_KEY: json.dumps(model.config.to_dict())})
