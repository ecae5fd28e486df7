"""Convert a causal checkpoint's training file into the ``.safetensors`` file ``load_wan`` and ComfyUI read.

``convert_checkpoint`` finds the generator's weights in a training checkpoint's dict (``.pt``, read with
torch's tensors-only unpickler: ``unpickle.py``), merges a LoRA in where one is given (``merge_lora``),
and records the checkpoint's config and sampling (``checkpoints.py``) in the file's metadata.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

from ..errors import FastARError
from .checkpoints import CONFIG_METADATA_KEY, SAMPLING_METADATA_KEY, KnownCheckpoint, Sampling, known_checkpoint
from .loading import MATRIX_GAME_KEY, infer_config, matching_model, strip_prefix
from .matrix_game import MATRIX_GAME_METADATA_KEY, detect
from .unpickle import read_tensors_only
from .wan import WanConfig

WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")  # FSDP / compile
# the generator's weights in the training checkpoints' dicts (Self-Forcing, CausVid, Causal-Forcing: EMA first)
STATE_KEYS = ("generator_ema", "generator", "model", "state_dict", "module")
LORA_KEYS = ("generator_lora",)  # LongLive's LoRA file: the generator's adapters (beside critic_lora)
LORA_WEIGHT = r"(.+)\.lora_([AB])(?:\.default)?\.weight"  # peft's names, with or without the adapter's
# what ComfyUI (with core's autoregressive nodes) reads to load a Wan file as its causal model
MATRIX_GAME_PRESET = "matrix-game-2"  # --preset: Skywork/Matrix-Game-2.0's files, variant detected
COMFY_CAUSAL_METADATA = {"config": json.dumps({"transformer": {"causal_ar": True}})}


def _tensors(d) -> bool:
    return isinstance(d, dict) and bool(d) and all(isinstance(v, torch.Tensor) for v in d.values())


def _entries(obj) -> str:
    return ", ".join(map(str, obj))[:200] if isinstance(obj, dict) else type(obj).__name__


def _unwrapped(k: str) -> str:
    for infix in WRAPPER_INFIXES:
        k = k.replace(infix, "")
    return k.removeprefix("module.")


def _is_lora(k: str) -> bool:
    return ".lora_A." in k or ".lora_B." in k or k.endswith(".base_layer.weight")


def _generator_state(obj, key: str | None, name: str, known: KnownCheckpoint | None = None) -> dict:
    """The Wan weights inside a training checkpoint's dict, with wrapper and prefix names removed: the
    entry ``key`` names, else a known checkpoint's entry (or the file itself where it is the weights),
    else the first of ``STATE_KEYS`` the file has."""
    adapters = isinstance(obj, dict) and any(_tensors(v) and any(map(_is_lora, v)) for v in obj.values())
    if key is None and known is not None and known.key is not None and not _tensors(obj):
        if not isinstance(obj, dict) or known.key not in obj:
            if adapters:
                raise FastARError(_not_a_full_model(name))
            raise FastARError(f"{name} has no entry {known.key!r}, where {known.repo}'s inference reads the "
                              f"{known.name} weights (entries: {_entries(obj)}); name the entry with --key")
        key = known.key
    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            raise FastARError(f"{name} has no entry {key!r} (entries: {_entries(obj)})")
        obj = obj[key]
    elif not _tensors(obj):
        found = next((k for k in STATE_KEYS if isinstance(obj, dict) and _tensors(obj.get(k))), None)
        if found is None:
            if adapters:
                raise FastARError(_not_a_full_model(name))
            raise FastARError(f"{name}: no Wan weights found (entries: {_entries(obj)}); name the entry that "
                              f"holds them with --key")
        obj = obj[found]
    if not _tensors(obj):
        raise FastARError(f"{name}: entry {key!r} is not a dict of tensors")
    state = {_unwrapped(k): v for k, v in obj.items()}
    if any(_is_lora(k) for k in state):
        raise FastARError(_not_a_full_model(name))
    return strip_prefix(state)


def _not_a_full_model(name: str) -> str:
    return (f"{name} holds LoRA adapters, not a full model (LongLive ships its LoRA apart from its base "
            f"weights): convert the base checkpoint with them merged in: "
            f"fastar convert BASE.pt DST.safetensors --lora {name}")


def _lora_state(obj, key: str | None, name: str) -> dict:
    """The peft LoRA state dict (``...lora_A.weight`` / ``...lora_B.weight``) in a LoRA file, wrapper
    names removed: the file itself where it is one, else the entry ``key`` names, else ``LORA_KEYS``' first."""
    if _tensors(obj):  # the adapters themselves (LongLive's inference takes either form)
        key = None
    elif key is None:
        key = next((k for k in LORA_KEYS if isinstance(obj, dict) and k in obj), None)
    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            raise FastARError(f"{name} has no entry {key!r} (entries: {_entries(obj)})")
        obj = obj[key]
    if not _tensors(obj):
        raise FastARError(f"{name}: no LoRA weights found (entries: {_entries(obj)}); name the entry that holds "
                          f"them with --lora-key")
    return {_unwrapped(k): v for k, v in obj.items()}


def merge_lora(state: dict, lora: dict, *, alpha: float | None = None, name: str = "the LoRA") -> tuple[dict, int]:
    """``state`` with a peft LoRA merged in, as peft's ``merge_and_unload`` does: each adapted linear
    layer's weight becomes W + (alpha / r) * B @ A (computed in float32; r, the rank, is lora_A's row
    count; ``alpha`` None: alpha = r, a scale of 1, as LongLive's adapter setup defaults it). Returns the
    merged state and the number of layers merged."""
    other = [k for k in lora if not re.fullmatch(LORA_WEIGHT, k)]
    if other:
        raise FastARError(f"{name} is not a LoRA of lora_A / lora_B weights: it holds {', '.join(other[:4])}"
                          f"{' ...' if len(other) > 4 else ''}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in lora.items():
        module, ab = re.fullmatch(LORA_WEIGHT, k).groups()
        pairs.setdefault(module.removeprefix("base_model.model.") + ".weight", {})[ab] = v
    named = strip_prefix(pairs)
    if len(named) != len(pairs):
        raise FastARError(f"{name}: its layers' names do not share one prefix "
                          f"({', '.join(sorted(pairs)[:2])} ...)")
    merged = dict(state)
    for weight, ab in sorted(named.items()):
        if set(ab) != {"A", "B"}:
            raise FastARError(f"{name}: {weight.removesuffix('.weight')} has lora_{next(iter(ab))} but no "
                              f"lora_{'B' if 'A' in ab else 'A'}")
        if weight not in state:
            raise FastARError(f"{name} adapts {weight.removesuffix('.weight')}, which the base checkpoint has no "
                              f"weight for")
        a, b, w = ab["A"], ab["B"], state[weight]
        if a.ndim != 2 or b.ndim != 2 or w.ndim != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != w.shape:
            raise FastARError(f"{name}: {weight.removesuffix('.weight')}'s lora_B {tuple(b.shape)} @ lora_A "
                              f"{tuple(a.shape)} does not fit its weight {tuple(w.shape)}")
        rank = a.shape[0]
        scale = (rank if alpha is None else alpha) / rank
        merged[weight] = w.float() + scale * (b.float() @ a.float())
    return merged, len(named)


@dataclass(frozen=True)
class Converted:
    """What ``convert_checkpoint`` wrote: the model's config, the sampling recorded (None: none known),
    how many linear layers a LoRA was merged into, and what kind of model it is, in words."""

    config: WanConfig
    sampling: Sampling | None
    lora_layers: int
    kind: str = "Wan 2.1 T2V"


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, preset: str | None = None,
                       key: str | None = None, lora: str | os.PathLike | None = None, lora_key: str | None = None,
                       lora_alpha: float | None = None, sampling: Sampling | None = None,
                       dtype: torch.dtype = torch.bfloat16, num_heads: int | None = None,
                       command: str = "fastar convert") -> Converted:
    """Write a causal checkpoint's Wan weights as a ``.safetensors`` file ComfyUI's Load Diffusion Model
    and ``load_wan`` read, marked causal (ComfyUI with core's autoregressive nodes loads it as its causal
    Wan model) and, where known, with its sampling in the metadata (``checkpoint_sampling`` reads it).

    ``preset`` names a known checkpoint (``KNOWN_CHECKPOINTS``): the entry its inference reads, its LoRA
    entry and alpha, its sampling; ``key``, ``lora_key``, ``lora_alpha`` and ``sampling`` override those.
    ``lora``: a LoRA file (LongLive's) merged into the weights (``merge_lora``). A ``.pt`` file is read
    with torch's tensors-only unpickler (``weights_only=True``): tensors and plain containers only, no code
    runs; a file holding other objects is refused in ``read_tensors_only``'s words. A ``.safetensors``
    source (Krea Realtime's) is read as it is. ``command``: how the user runs the converter, for the
    command a refusal ends with."""
    from safetensors.torch import save_file

    known = known_checkpoint(preset) if preset not in (None, MATRIX_GAME_PRESET) else None
    src, dst = os.fspath(src), os.fspath(dst)
    name = os.path.basename(src)
    for path in (src, *([os.fspath(lora)] if lora is not None else [])):
        if not os.path.isfile(path):
            raise FastARError(f"checkpoint not found: {path}")
    if not dst.endswith(".safetensors"):
        raise FastARError(f"{dst}: the output must be a .safetensors file")
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise FastARError(f"{dst}: write the converted file beside its source, not over it")
    # the flags of the command that converts a refused file's re-saved weights (the message's last words)
    preset_flag = f" --preset {preset}" if preset else ""
    key_flag = f" --key {key}" if key else ""
    lora_flag = f" --lora {os.fspath(lora)}" if lora is not None else ""
    entry = key or (known.key if known and known.key else "generator_ema")
    state = _generator_state(_read_source(src, entry, lambda w: f"{command} {w} {dst}{preset_flag}{lora_flag}"),
                             key, name, known)
    merged = 0
    if lora is not None:
        lora, lora_key = os.fspath(lora), lora_key or (known.lora_key if known else None)
        adapters = _lora_state(_read_source(lora, lora_key or LORA_KEYS[0],
                                            lambda w: f"{command} {src} {dst}{preset_flag}{key_flag} --lora {w}"),
                               lora_key, os.path.basename(lora))
        alpha = lora_alpha if lora_alpha is not None else (known.lora_alpha if known else None)
        state, merged = merge_lora(state, adapters, alpha=alpha, name=os.path.basename(lora))
    if MATRIX_GAME_KEY in state:
        config, actions, variant = detect(state, num_heads)
        matching_model(state, config, name, actions=actions)
        sampling = sampling or variant.sampling
        kind = f"Matrix-Game 2.0 {variant.name} (CLIP-vision context, actions)"
        metadata = {CONFIG_METADATA_KEY: json.dumps(config.to_dict()),
                    MATRIX_GAME_METADATA_KEY: json.dumps({"variant": variant.name, "keys": variant.keys,
                                                          "mouse": variant.mouse, **actions.to_dict()})}
    elif preset == MATRIX_GAME_PRESET:
        raise FastARError(f"{name} is not a Matrix-Game 2.0 model (no blocks.N.action_model weights); "
                          f"--preset {MATRIX_GAME_PRESET} converts Skywork/Matrix-Game-2.0's files")
    else:
        config = infer_config(state, num_heads)
        matching_model(state, config, name)
        kind = Converted.kind
        sampling = sampling or (known.sampling if known else None)
        metadata = {CONFIG_METADATA_KEY: json.dumps(config.to_dict()), **COMFY_CAUSAL_METADATA}
    if sampling is not None:
        metadata[SAMPLING_METADATA_KEY] = sampling.to_json()
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, dst, metadata=metadata)
    return Converted(config, sampling, merged, kind)


def _read_source(path: str, entry: str, then) -> dict:
    """A checkpoint's contents: a ``.safetensors`` file's tensors, else ``read_tensors_only``'s."""
    if not path.endswith(".safetensors"):
        return read_tensors_only(path, os.path.basename(path), entry, then)
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:
        raise FastARError(f"{os.path.basename(path)} is not a readable safetensors file: {exc}") from None
