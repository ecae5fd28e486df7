"""What runs a rollout's forwards, and the rollout on it (``choose_engine``, ``engine_rollout``):

- ``fused``: the library's Wan forward over the ComfyUI model's own parameter tensors (``fused.fused_wan``),
  with per-chunk CUDA graphs on a GPU: the library's speed, weight patches as ComfyUI applied them. Taken
  wherever it computes what ComfyUI's forward would; ``_fused_blocker`` names what stands in the way otherwise.
- ``comfy``: ComfyUI's own forward through ``BaseModel.apply_model`` with FAST-AR's attention patched in
  (``patching.ComfyChunkModel``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

import comfy.model_sampling
import comfy.patcher_extension

from ..fastar import FastARError, Rollout
from .fused import COMPUTE_DTYPES, STORED_DTYPES, fused_wan
from .patching import WRAPPER_KEY, ComfyChunkModel
from .settings import FastARSettings, settings_of
from .wan import compute_dtype, wan_diffusion_model

# ComfyUI's layer classes whose forward is a plain layer over its (cast) weight; its fp8 matmul and
# scaled / quantized ops compute otherwise.
_PLAIN_OPS = ("disable_weight_init.", "manual_cast.")


@dataclass
class Engine:
    """What runs a rollout's forwards (``fused`` or ``comfy``, see the module docstring); ``reason``: why
    the fused engine could not run."""
    name: str
    model: object
    reason: str | None = None


def _fused_blocker(patcher, dm, options: dict, model_options: dict) -> str | None:
    """Why the fused forward would not compute what ComfyUI's forward computes, or None."""
    ms = patcher.model.model_sampling
    if not isinstance(ms, comfy.model_sampling.CONST) or float(getattr(ms, "multiplier", 0.0)) != 1000.0:
        return f"the model samples with {type(ms).__name__} (multiplier {getattr(ms, 'multiplier', '?')})"
    if compute_dtype(patcher) not in COMPUTE_DTYPES:
        return f"it computes in {compute_dtype(patcher)}"
    device = torch.device(patcher.load_device)
    for name, p in dm.named_parameters():
        if p.device != device or p.device.type == "meta":
            return f"its weights are not all on {device} ({name} is on {p.device}: offloaded or partly loaded)"
        if p.dtype not in STORED_DTYPES:
            return f"its weights are stored in {p.dtype} ({name})"
    for name, m in dm.named_modules():
        if getattr(m, "weight_function", None) or getattr(m, "bias_function", None):
            return f"{name or 'the model'} patches its weights on every call (low-VRAM loading)"
        if type(m).__module__ == "comfy.ops" and not type(m).__qualname__.startswith(_PLAIN_OPS):
            return f"{name} runs ComfyUI's {type(m).__qualname__} layer (fp8 matmuls or scaled weights)"
    patched = sorted(k for k in patcher.object_patches if k.startswith("diffusion_model"))
    if patched:
        return f"another node replaced {patched[0]} (an object patch)"
    if (options.get("patches_replace") or {}).get("dit"):
        return "another node replaces some of its blocks (patches_replace)"
    if model_options.get("model_function_wrapper") is not None:
        return "another node wraps its apply_model (model_function_wrapper)"
    for kind in (comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, comfy.patcher_extension.WrappersMP.APPLY_MODEL):
        others = sorted(k for k, w in (options.get("wrappers", {}).get(kind) or {}).items() if k != WRAPPER_KEY and w)
        if others:
            return f"another node wraps its {kind} ({others[0]})"
    override = options.get("optimized_attention_override")
    previous = getattr(override, "fastar_previous", override)
    if previous is not None:
        return f"another node overrides its attention ({getattr(previous, '__name__', type(previous).__name__)})"
    return None


def choose_engine(patcher, options: dict, model_options: dict, node: str) -> Engine:
    """The fused engine wherever it computes what ComfyUI's forward would; ComfyUI's own otherwise."""
    dm = wan_diffusion_model(patcher, node)
    reason = _fused_blocker(patcher, dm, options, model_options)
    if reason is None:
        try:
            fp8 = settings_of(patcher).fp8_linears
            return Engine("fused", fused_wan(dm, compute_dtype(patcher), fp8_linears=fp8))
        except (FastARError, RuntimeError, KeyError) as exc:  # a structure the library's Wan does not have
            reason = f"its parameters do not map onto the Wan 2.1 forward ({str(exc).splitlines()[0]})"
    from comfy.ldm.wan.model import WanModel

    if not isinstance(dm, WanModel):  # only ComfyUI's WanModel passes transformer_options to its blocks
        raise FastARError(f"{node}: this {type(dm).__name__} runs only on FAST-AR's fused engine, which cannot "
                          f"run here: {reason}")
    return Engine("comfy", ComfyChunkModel(patcher, options), reason)


_last_engine_message = None


def log_engine(engine: Engine, node: str, device, cuda_graphs: bool) -> None:
    """Say which engine runs and how on ``device`` (CUDA graphs only where the rollout replays them),
    once for each change (not once per run)."""
    global _last_engine_message
    where = f"on {torch.device(device)}"
    if engine.name == "fused":
        how = "repeating chunks replayed from CUDA graphs" if cuda_graphs else "op by op, no CUDA graphs"
        message, level = f"{node}: engine fused (FAST-AR's forward over the model's weights {where}, {how})", \
            logging.INFO
    else:
        message, level = f"{node}: engine comfy (ComfyUI's forward, FAST-AR attention, {where}): {engine.reason}", \
            logging.WARNING
    if message != _last_engine_message:
        _last_engine_message = message
        logging.log(level, message)


def engine_rollout(patcher, options: dict, model_options: dict, texts, device, node: str,
                   on_engine: Callable[[Engine], None] | None, fastar: FastARSettings, **settings) -> Rollout:
    """The rollout over ``texts`` (``prompts.prompt_contexts``) with ``fastar``'s cache and sparse attention,
    on the engine ``choose_engine`` picks; ``settings``: the rest of ``Rollout``'s keywords, which differ
    between the two samplers."""
    context, switches, negative = texts
    engine = choose_engine(patcher, options, model_options, node)
    if on_engine is not None:
        on_engine(engine)
    if engine.name == "comfy":
        engine.model.cond_or_uncond = [0, 1] if negative is not None else [0]
    rollout = Rollout(engine.model, context.to(device),
                      negative_context=None if negative is None else negative.to(device),
                      prompts=[(c, t.to(device)) for c, t in switches],
                      cache=fastar.cache, ann=fastar.ann, **settings)
    log_engine(engine, node, rollout.device, rollout.cuda_graphs)
    return rollout

