"""Build Wan models: random weights at a named size, or a ``.safetensors`` checkpoint.

Checkpoints are read with safetensors only (a pickle can run code); ``convert_checkpoint``
turns a training checkpoint (``.pt``, read with torch's tensors-only unpickler) into one. Keys
may carry the prefixes ComfyUI or training code put in front (``model.diffusion_model.`` ...).
The size is read off the tensor shapes; the head count, which shapes cannot give, comes from
the file's metadata when present, else Wan's head_dim of 128.
"""
from __future__ import annotations

import json
import os
import re

import torch

from ..errors import FastARError
from .wan import WAN_CONFIGS, WanConfig, WanModel

KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")  # FSDP / compile
# the generator's weights in the training checkpoints' dicts (Self-Forcing, CausVid, Causal-Forcing: EMA first)
STATE_KEYS = ("generator_ema", "generator", "model", "state_dict", "module")
# what ComfyUI (with core's autoregressive nodes) reads to load a Wan file as its causal model
COMFY_CAUSAL_METADATA = {"config": json.dumps({"transformer": {"causal_ar": True}})}
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


def _matching_model(state_dict: dict, config: WanConfig, name: str) -> WanModel:
    """A meta-device Wan model whose parameter names are exactly ``state_dict``'s, or one clear error."""
    with torch.device("meta"):
        model = WanModel(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise FastARError(f"{name} does not match a Wan 2.1 T2V model of dim {config.dim}: "
                          f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                          f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    return model


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
                          "(pickled .pt/.ckpt files can run code); convert it first: fastar convert FILE.pt FILE.safetensors")
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
    model = _matching_model(state_dict, config, os.path.basename(path))
    dtype = dtype or state_dict["blocks.0.self_attn.q.weight"].dtype
    model.load_state_dict(state_dict, assign=True)
    return model.to(dtype).eval().requires_grad_(False)


def save_wan(model: WanModel, path: str | os.PathLike) -> None:
    """Write a model as safetensors with its config in the metadata."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path),
              metadata={CONFIG_METADATA_KEY: json.dumps(model.config.to_dict())})


def _generator_state(obj, key: str | None, name: str) -> dict:
    """The Wan weights inside a training checkpoint's dict, with wrapper and prefix names removed."""
    def tensors(d):
        return isinstance(d, dict) and d and all(isinstance(v, torch.Tensor) for v in d.values())

    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            raise FastARError(f"{name} has no entry {key!r} (entries: {', '.join(map(str, obj))[:200]})")
        obj = obj[key]
    elif not tensors(obj):
        found = next((k for k in STATE_KEYS if isinstance(obj, dict) and tensors(obj.get(k))), None)
        if found is None:
            entries = ", ".join(map(str, obj))[:200] if isinstance(obj, dict) else type(obj).__name__
            raise FastARError(f"{name}: no Wan weights found (entries: {entries}); name the entry that holds "
                              f"them with --key")
        obj = obj[found]
    if not tensors(obj):
        raise FastARError(f"{name}: entry {key!r} is not a dict of tensors")
    state = {}
    for k, v in obj.items():
        for infix in WRAPPER_INFIXES:
            k = k.replace(infix, "")
        state[k.removeprefix("module.")] = v
    if any(".lora_A." in k or ".lora_B." in k or k.endswith(".base_layer.weight") for k in state):
        raise FastARError(f"{name} holds LoRA adapters (LongLive ships its LoRA apart): merge them into the base "
                          f"weights first; this converter writes full models only")
    return strip_prefix(state)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, key: str | None = None,
                       dtype: torch.dtype = torch.bfloat16, num_heads: int | None = None) -> WanConfig:
    """Write a training checkpoint's Wan weights as a ``.safetensors`` file ComfyUI's Load Diffusion
    Model and ``load_wan`` read (marked causal, so ComfyUI with core's autoregressive nodes loads it as
    its causal Wan model). The ``.pt`` file is read with torch's tensors-only unpickler
    (``weights_only=True``): tensors and plain containers only, no code runs; a file holding other
    objects is refused in ``_read_tensors_only``'s words."""
    from safetensors.torch import save_file

    src, dst = os.fspath(src), os.fspath(dst)
    name = os.path.basename(src)
    if not os.path.isfile(src):
        raise FastARError(f"checkpoint not found: {src}")
    if not dst.endswith(".safetensors"):
        raise FastARError(f"{dst}: the output must be a .safetensors file")
    obj = _read_tensors_only(src, name, key, dst)
    state = _generator_state(obj, key, name)
    config = infer_config(state, num_heads)
    _matching_model(state, config, name)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, dst,
              metadata={CONFIG_METADATA_KEY: json.dumps(config.to_dict()), **COMFY_CAUSAL_METADATA})
    return config


def _read_tensors_only(src: str, name: str, key: str | None, dst: str):
    """``torch.load`` of a training checkpoint with the tensors-only unpickler, or one FastARError that
    says what the file holds, that nothing in it ran, and how its owner re-saves the weights as tensors."""
    import pickle

    try:
        try:
            return torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _objects_in(src, str(exc))
        if not found:  # not a class the unpickler refused: a damaged or foreign file
            raise FastARError(f"{name} is not a torch checkpoint this converter can read ({_first_line(exc)}); "
                              f"nothing was written") from None
        raise FastARError(_refusal(src, name, found, key, dst)) from None
    except Exception as exc:
        raise FastARError(f"{name} is not a torch checkpoint this converter can read ({type(exc).__name__}: "
                          f"{_first_line(exc)}); nothing was written") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _objects_in(src: str, message: str) -> list[str]:
    """The classes (``module.Name``) the tensors-only unpickler refuses in ``src``: all of them where
    torch can list them without running anything, else the one its message names."""
    listed = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if listed is not None:
        try:
            found = [g for g in listed(src) if re.fullmatch(r"[\w.]+", g)]
            if found:
                return sorted(found)
        except Exception:  # a legacy file: fall back to the message
            pass
    return sorted(set(re.findall(r"GLOBAL ([\w.]+)", message)))


# modules whose names in a pickle mean calls, not data: a file naming them would run code when loaded
CODE_MODULES = ("builtins", "os", "posix", "nt", "sys", "subprocess", "shutil", "pathlib", "importlib", "runpy",
                "operator", "functools", "codecs", "socket", "webbrowser", "pty", "code", "types", "io", "pickle",
                "marshal", "ctypes", "multiprocessing", "threading", "signal", "inspect", "eval", "exec")


def _refusal(src: str, name: str, found: list[str], key: str | None, dst: str) -> str:
    """What a refused checkpoint holds and, for data objects (a config, an optimizer's state), the one
    line of Python that re-saves its weights as tensors, run where the checkpoint was made (those classes
    import there, and the file is the user's to trust). A file naming calls gets no such line."""
    calls = [g for g in found if g.split(".", 1)[0] in CODE_MODULES]
    if calls:
        return (f"{name} carries code: loading it would call {', '.join(calls)}. Nothing in the file ran and "
                f"nothing was written. A model checkpoint needs no such calls; get the weights from the "
                f"checkpoint's authors (a .safetensors file or a plain state dict)")
    modules = sorted({g.rsplit(".", 1)[0] for g in found if "." in g and not g.startswith("__main__.")})
    weights = os.path.splitext(src)[0] + "_weights.pt"
    entry = key or "generator_ema"
    line = (f"python -c \"import torch{''.join(', ' + m for m in modules)}; "
            f"torch.serialization.add_safe_globals([{', '.join(found)}]); "
            f"ck = torch.load('{src}', map_location='cpu'); torch.save(ck['{entry}'], '{weights}')\"")
    what = ", ".join(found)
    return (f"{name} holds {'objects' if len(found) > 1 else 'an object'} of {what} beside its tensors, which the "
            f"converter's tensors-only read does not build: nothing in the file ran and nothing was written. "
            f"If the file is yours or from a source you trust, re-save the model's weights as tensors once, with "
            f"the Python and packages the checkpoint was made with (where {what} "
            f"{'import' if len(found) > 1 else 'imports'}), naming the entry that holds them (often generator_ema "
            f"or generator): {line} ; then convert that file: fastar convert {weights} {dst}")
