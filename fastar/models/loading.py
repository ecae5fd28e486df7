"""Build Wan models: random weights at a named size, or a ``.safetensors`` checkpoint.

Checkpoints are read with safetensors only (a pickle can run code); ``convert_checkpoint``
turns a training checkpoint (``.pt``, read with torch's tensors-only unpickler) into one, a LoRA
merged in where one is given, and records the checkpoint's sampling (``checkpoints.py``). Keys
may carry the prefixes ComfyUI or training code put in front (``model.diffusion_model.`` ...).
The size is read off the tensor shapes; the head count, which shapes cannot give, comes from
the file's metadata when present, else Wan's head_dim of 128.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

from ..errors import FastARError
from .checkpoints import SAMPLING_METADATA_KEY, KnownCheckpoint, Sampling, known_checkpoint
from .wan import WAN_CONFIGS, WanConfig, WanModel
from .matrix_game import MATRIX_GAME_METADATA_KEY, MatrixGameModel, detect
from .world import WORLD_METADATA_KEY, WorldModel, WorldSpec

KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")  # FSDP / compile
# the generator's weights in the training checkpoints' dicts (Self-Forcing, CausVid, Causal-Forcing: EMA first)
STATE_KEYS = ("generator_ema", "generator", "model", "state_dict", "module")
LORA_KEYS = ("generator_lora",)  # LongLive's LoRA file: the generator's adapters (beside critic_lora)
LORA_WEIGHT = r"(.+)\.lora_([AB])(?:\.default)?\.weight"  # peft's names, with or without the adapter's
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


def _matching_model(state_dict: dict, config: WanConfig, name: str, world=None, actions=None,
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
        config = WanConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in json.loads(metadata[CONFIG_METADATA_KEY]).items()})
    else:
        config = infer_config(state_dict, num_heads)
    if WORLD_METADATA_KEY in metadata:
        world = WorldSpec.from_json(metadata[WORLD_METADATA_KEY])
    model = _matching_model(state_dict, config, os.path.basename(path), world, actions, variant)
    dtype = dtype or state_dict["blocks.0.self_attn.q.weight"].dtype
    model.load_state_dict(state_dict, assign=True)
    return model.to(dtype).eval().requires_grad_(False)


MATRIX_GAME_KEY = "blocks.0.action_model.keyboard_embed.0.weight"  # a Matrix-Game 2.0 file has it
MATRIX_GAME_PRESET = "matrix-game-2"  # fastar convert --preset: Skywork/Matrix-Game-2.0's files, variant detected


def _metadata_heads(metadata: dict) -> int | None:
    """The head count a converted file's config records (None: none recorded)."""
    return json.loads(metadata[CONFIG_METADATA_KEY])["num_heads"] if CONFIG_METADATA_KEY in metadata else None


def save_wan(model: WanModel, path: str | os.PathLike) -> None:
    """Write a model as safetensors with its config in the metadata."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path),
              metadata={CONFIG_METADATA_KEY: json.dumps(model.config.to_dict())})


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
    and how many linear layers a LoRA was merged into."""

    config: WanConfig
    sampling: Sampling | None
    lora_layers: int


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
    runs; a file holding other objects is refused in ``_read_tensors_only``'s words. A ``.safetensors``
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
        _matching_model(state, config, name, actions=actions)
        sampling = sampling or variant.sampling
        metadata = {CONFIG_METADATA_KEY: json.dumps(config.to_dict()),
                    MATRIX_GAME_METADATA_KEY: json.dumps({"variant": variant.name, "keys": variant.keys,
                                                          "mouse": variant.mouse, **actions.to_dict()})}
    elif preset == MATRIX_GAME_PRESET:
        raise FastARError(f"{name} is not a Matrix-Game 2.0 model (no blocks.N.action_model weights); "
                          f"--preset {MATRIX_GAME_PRESET} converts Skywork/Matrix-Game-2.0's files")
    else:
        config = infer_config(state, num_heads)
        _matching_model(state, config, name)
        sampling = sampling or (known.sampling if known else None)
        metadata = {CONFIG_METADATA_KEY: json.dumps(config.to_dict()), **COMFY_CAUSAL_METADATA}
    if sampling is not None:
        metadata[SAMPLING_METADATA_KEY] = sampling.to_json()
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, dst, metadata=metadata)
    return Converted(config, sampling, merged)


def checkpoint_sampling(path: str | os.PathLike) -> Sampling | None:
    """The sampling a converted ``.safetensors`` file records (frames per block, timesteps, shift), or None."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            text = (f.metadata() or {}).get(SAMPLING_METADATA_KEY)
    except Exception as exc:
        raise FastARError(f"{os.path.basename(os.fspath(path))} is not a readable safetensors file: {exc}") from None
    return None if text is None else Sampling.from_json(text)


def _read_source(path: str, entry: str, then) -> dict:
    """A checkpoint's contents: a ``.safetensors`` file's tensors, else ``_read_tensors_only``'s."""
    if not path.endswith(".safetensors"):
        return _read_tensors_only(path, os.path.basename(path), entry, then)
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:
        raise FastARError(f"{os.path.basename(path)} is not a readable safetensors file: {exc}") from None


def _read_tensors_only(src: str, name: str, entry: str, then):
    """``torch.load`` of a training checkpoint with the tensors-only unpickler, or one FastARError that
    says what the file holds, that nothing in it ran, and how its owner re-saves the weights as tensors
    (``entry`` of it, then the command ``then(weights_file)``)."""
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
        raise FastARError(_refusal(src, name, found, entry, then)) from None
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


class _Inert:
    """What ``_pickled_entries`` builds for any class or call a pickle names: keeps its arguments, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):  # a dict subclass's items
        pass


def _pickled_entries(src: str) -> dict[str, int | str] | None:
    """A torch zip checkpoint's top-level entries, read without running anything in it: an entry's count
    of tensors, or the class of what it holds; None where the file is not such a checkpoint."""
    import pickle
    import zipfile

    class Dict(dict):  # a state dict: an OrderedDict whose pickle sets its _metadata after its items
        def __setstate__(self, state):
            pass

    class Inert(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in (("collections", "OrderedDict"), ("builtins", "dict")):
                return Dict
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return _Tensor
            return type(f"{module}.{name}", (_Inert,), {})

        def persistent_load(self, pid):
            return None

    class _Tensor(_Inert):
        pass

    try:
        with zipfile.ZipFile(src) as z:
            data = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            top = Inert(z.open(data)).load()
    except Exception:
        return None
    if not isinstance(top, dict):
        return None

    def describe(value):
        if isinstance(value, dict):
            return sum(isinstance(v, _Tensor) for v in value.values())
        return type(value).__name__

    return {str(k): describe(v) for k, v in top.items()}


def _refusal(src: str, name: str, found: list[str], entry: str, then) -> str:
    """What a refused checkpoint holds (its entries, where they can be read without running anything) and,
    for data objects (a config, an optimizer's state), the one line of Python that re-saves its weights
    as tensors, run where the checkpoint was made (those classes import there; a class of the training
    script's own, ``__main__.X``, is stood in for by an empty one) and the file is the user's to trust.
    A file naming calls gets no such line."""
    calls = [g for g in found if g.split(".", 1)[0] in CODE_MODULES]
    if calls:
        return (f"{name} carries code: loading it would call {', '.join(calls)}. Nothing in the file ran and "
                f"nothing was written. A model checkpoint needs no such calls; get the weights from the "
                f"checkpoint's authors (a .safetensors file or a plain state dict)")
    entries = _pickled_entries(src) or {}
    weighty = {k: v for k, v in entries.items() if isinstance(v, int) and v > 0}
    if entry not in weighty and weighty:  # the entry that holds the most tensors, not a guess
        entry = max(weighty, key=weighty.get)
    def held(k, v):
        if isinstance(v, int):
            return f"{k} ({v} tensor{'' if v == 1 else 's'})"
        return f"{k} ({'an' if v[:1].lower() in 'aeiou' else 'a'} {v})"

    listed = "; its entries: " + ", ".join(held(k, v) for k, v in entries.items()) if entries else ""
    modules = sorted({g.rsplit(".", 1)[0] for g in found if "." in g and not g.startswith("__main__.")})
    own = [g.split(".", 1)[1] for g in found if g.startswith("__main__.")]
    stand_ins = ("import __main__; " + "; ".join(f"__main__.{n} = type('{n}', (), {{}})" for n in own) + "; "
                 if own else "")
    weights = os.path.splitext(src)[0] + "_weights.pt"
    line = (f"python -c \"import torch{''.join(', ' + m for m in modules)}; {stand_ins}"
            f"torch.serialization.add_safe_globals([{', '.join(found)}]); "
            f"ck = torch.load('{src}', map_location='cpu'); torch.save(ck['{entry}'], '{weights}')\"")
    what = ", ".join(found)
    return (f"{name} holds {'objects' if len(found) > 1 else 'an object'} of {what} beside its tensors{listed}, "
            f"which the converter's tensors-only read does not build: nothing in the file ran and nothing was "
            f"written. If the file is yours or from a source you trust, re-save the model's weights ({entry}) as "
            f"tensors once, with the Python and packages the checkpoint was made with: {line} ; then convert "
            f"that file: {then(weights)}")
