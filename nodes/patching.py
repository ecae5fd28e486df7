"""The attention patch: what FAST-AR Patch Model adds to a ``ModelPatcher.clone()`` so that ComfyUI's own
Wan forward runs FAST-AR's attention inside a rollout, and nothing changes outside one. A keyed
``DIFFUSION_MODEL`` wrapper gives each forward the chunk's temporal RoPE offset and counts its attention
calls; an ``optimized_attention_override``, chained to any override already set, sends self-attention
through the rollout's KV cache and cross-attention through its prompt path. ``ComfyChunkModel`` is that
patched forward as a ``fastar.ChunkModel`` (the comfy engine)."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

import comfy.model_sampling
import comfy.patcher_extension

from ..fastar import FastARError
from .settings import SETTINGS_KEY, FastARSettings
from .wan import compute_dtype, wan_diffusion_model

WRAPPER_KEY = "fastar"            # key of our DIFFUSION_MODEL wrapper
STATE_KEY = "fastar_rollout"      # transformer_options key present only inside a rollout
CALL_KEY = "fastar_forward"       # per-forward attention bookkeeping (set by the wrapper)


@functools.lru_cache(maxsize=None)
def _rope_reads_options(cls) -> bool:
    """Newer ComfyUI's ``rope_encode`` reads ``transformer_options["rope_options"]``; older takes only t_start."""
    return "transformer_options" in inspect.signature(cls.rope_encode).parameters

@dataclass
class _ForwardCall:
    """Attention bookkeeping of one diffusion-model forward inside a rollout."""
    state: "RolloutState"
    calls: int = 0
    per_block: dict = field(default_factory=dict)

    def site(self, transformer_options, q_len: int, k_len: int) -> tuple[int, str]:
        """(layer, 'self' | 'cross') of the current attention call.

        Wan blocks call self-attention, then cross-attention. Newer ComfyUI passes the block
        index; older versions are counted (two calls per block).
        """
        block = transformer_options.get("block_index")
        if block is None:
            layer, nth = divmod(self.calls, 2)
        else:
            layer = int(block)
            nth = self.per_block.get(layer, 0)
            self.per_block[layer] = nth + 1
        self.calls += 1
        if nth > 1 or layer >= self.state.num_layers:
            raise FastARError(f"unexpected attention call #{nth + 1} in block {layer}: FAST-AR supports the "
                              f"stock Wan 2.1 T2V blocks (one self- and one cross-attention each)")
        kind = "self" if nth == 0 else "cross"
        if kind == "self" and k_len != q_len:
            raise FastARError(f"block {layer}: expected self-attention first, got {q_len} queries on {k_len} keys")
        return layer, kind


def _plain(t):
    """A tensor, unwrapping ComfyUI's single-owner attention containers where they are passed."""
    if isinstance(t, torch.Tensor):
        return t
    take = getattr(t, "take", None)
    if take is None:
        raise FastARError(f"attention got a {type(t).__name__}, expected a tensor")
    return take()


def _fastar_attention(call: _ForwardCall, q, k, v, heads, kwargs):
    if kwargs.get("mask") is not None:
        raise FastARError("FAST-AR attention got an attention mask; the stock Wan blocks pass none")
    q, k, v = _plain(q), _plain(k), _plain(v)
    if kwargs.get("skip_reshape", False):  # [B, H, L, D]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    else:                                  # [B, L, H*D]
        q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
    layer, kind = call.site(kwargs.get("transformer_options") or {}, q.shape[1], k.shape[1])
    attention = call.state.attention
    out = attention.self_attention(layer, q, k, v) if kind == "self" else attention.cross_attention(layer, q, k, v)
    if kwargs.get("skip_output_reshape", False):
        return out.transpose(1, 2)
    return out.flatten(2)


def _make_attention_override(previous: Callable | None) -> Callable:
    def fastar_attention_override(func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        call = options.get(CALL_KEY)
        if call is None:  # not inside a rollout forward: exactly what ComfyUI would do
            if previous is not None:
                return previous(func, *args, **kwargs)
            return func(*args, **kwargs)
        q, k, v = args[:3]
        heads = kwargs["heads"] if "heads" in kwargs else args[3]
        return _fastar_attention(call, q, k, v, heads, kwargs)

    fastar_attention_override.fastar_previous = previous
    return fastar_attention_override


def _diffusion_model_wrapper(executor, x, timestep, context, clip_fea=None, time_dim_concat=None,
                             transformer_options=None, **kwargs):
    state = (transformer_options or {}).get(STATE_KEY)
    if state is None or CALL_KEY in transformer_options:  # outside a rollout (or already set up by us)
        return executor(x, timestep, context, clip_fea, time_dim_concat, transformer_options, **kwargs)
    dm = executor.class_obj
    options = dict(transformer_options)
    call = options[CALL_KEY] = _ForwardCall(state)
    if _rope_reads_options(type(dm)):
        rope = dict(options.get("rope_options") or {})
        rope["shift_t"] = rope.get("shift_t", 0.0) + state.frame_offset
        options["rope_options"] = rope
        out = executor(x, timestep, context, clip_fea, time_dim_concat, options, **kwargs)
    else:
        # Older ComfyUI: rope_encode has no rope_options; give it this chunk's t_start for this call.
        had_own = "rope_encode" in vars(dm)
        own = vars(dm).get("rope_encode")
        dm.rope_encode = functools.partial(type(dm).rope_encode.__get__(dm), t_start=state.frame_offset)
        try:
            out = executor(x, timestep, context, clip_fea, time_dim_concat, options, **kwargs)
        finally:
            if had_own:
                dm.rope_encode = own
            else:
                del dm.rope_encode
    if call.calls != 2 * state.num_layers:  # something bypassed ComfyUI's attention dispatch
        raise FastARError(f"only {call.calls} of the model's {2 * state.num_layers} attention calls reached FAST-AR; "
                          f"a patch that replaces the Wan attention (not through optimized_attention) is in the way")
    return out


def is_patched(model) -> bool:
    override = model.model_options.get("transformer_options", {}).get("optimized_attention_override")
    return bool(model.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)) and \
        hasattr(override, "fastar_previous")


def patch_model(model, settings: FastARSettings | None = None, node: str = "FAST-AR Patch Model"):
    """A clone of ``model`` routed through FAST-AR during rollouts, carrying ``settings`` (default:
    ``FastARSettings()``) for the samplers; ``model`` is not modified."""
    wan_diffusion_model(model, node)
    m = model.clone()
    m.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, _diffusion_model_wrapper)
    options = m.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    if hasattr(previous, "fastar_previous"):  # re-patching: chain to what was there before us
        previous = previous.fastar_previous
    options["optimized_attention_override"] = _make_attention_override(previous)
    m.model_options[SETTINGS_KEY] = FastARSettings() if settings is None else settings
    return m


def transformer_options(model, model_options: dict, prepared: bool = False) -> dict:
    """transformer_options as ComfyUI's sampler assembles them: hook patches, the model's
    options, its wrappers and callbacks (already merged in when ``prepared`` by
    ``comfy.sampler_helpers.prepare_model_patcher``)."""
    options = model.model.current_patcher.apply_hooks(hooks=None) if model.model.current_patcher is not None else {}
    options = comfy.patcher_extension.merge_nested_dicts(options, model_options.get("transformer_options", {}),
                                                         copy_dict1=False)
    options = comfy.patcher_extension.copy_nested_dicts(options)
    if prepared:
        return options
    comfy.patcher_extension.merge_nested_dicts(options.setdefault("wrappers", {}), model.wrappers, copy_dict1=False)
    comfy.patcher_extension.merge_nested_dicts(options.setdefault("callbacks", {}), model.callbacks, copy_dict1=False)
    return options


@dataclass
class RolloutState:
    """What the wrapper and the override need during one chunk forward."""
    attention: object
    frame_offset: int
    num_layers: int


class ComfyChunkModel:
    """A patched ComfyUI Wan model as a ``fastar.ChunkModel``.

    ``__call__`` returns the flow v of a chunk: ComfyUI's ``apply_model`` returns the denoised
    x0 = x - sigma * v, so v = (x - x0) / sigma (sigma in float64). At sigma = 0 (the clean
    cache-fill pass at context noise 0) the flow is not observable through x0 and zeros are
    returned; the rollout uses only that pass's K/V.
    """

    def __init__(self, model, options: dict):
        """``options``: the rollout's transformer_options (``transformer_options``)."""
        self.patcher = model
        self.base = model.model
        self.dm = wan_diffusion_model(model)
        ms = self.base.model_sampling
        if not (hasattr(ms, "multiplier") and isinstance(ms, comfy.model_sampling.CONST)):
            raise FastARError(f"FAST-AR needs a flow-matching model; this one samples with {type(ms).__name__}")
        self.multiplier = float(ms.multiplier)
        current = options.get("optimized_attention_override")
        if not hasattr(current, "fastar_previous"):  # an override set after FAST-AR Patch Model: chain it
            options = dict(options, optimized_attention_override=_make_attention_override(current))
        kind = comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL
        wrappers = options.get("wrappers") or {}
        if WRAPPER_KEY not in (wrappers.get(kind) or {}):  # a model FAST-AR Patch Model never saw
            wrappers = dict(wrappers, **{kind: {**(wrappers.get(kind) or {}), WRAPPER_KEY: [_diffusion_model_wrapper]}})
            options = dict(options, wrappers=wrappers)
        self.transformer_options = options
        self.cond_or_uncond = [0]
        dm = self.dm  # the ChunkModel geometry
        self.num_layers, self.num_heads, self.head_dim = len(dm.blocks), dm.num_heads, dm.dim // dm.num_heads
        self.latent_channels, self.context_dim, self.patch_size = dm.in_dim, dm.text_dim, tuple(dm.patch_size)
        self.dtype = compute_dtype(model)

    def __call__(self, x, t, context, *, frame_offset: int, attention):
        sigma = t.to(torch.float64) / self.multiplier
        options = dict(self.transformer_options)
        options[STATE_KEY] = RolloutState(attention, int(frame_offset), self.num_layers)
        options["cond_or_uncond"] = list(self.cond_or_uncond)
        options["sigmas"] = sigma
        x0 = self.base.apply_model(x, sigma, c_crossattn=context, transformer_options=options)
        s = sigma.view(-1, *([1] * (x.ndim - 1)))
        v = torch.where(s > 0, (x.to(torch.float64) - x0.to(torch.float64)) / s.clamp_min(1e-30), 0.0)
        return v.to(torch.float32)
