"""The bridge between ComfyUI and ``fastar``: patching, the samplers and everything else that reaches
into ComfyUI's model internals (``video`` reaches into its VAE).

A rollout runs on one of two engines (``choose_engine``):

- ``fused``: the library's Wan forward (``fastar.models.WanModel``) over the ComfyUI model's own
  parameter tensors, with per-chunk CUDA graphs on a GPU: the library's speed, no second copy of the weights,
  weight patches as ComfyUI applied them. Taken wherever it computes what ComfyUI's forward would;
  ``_fused_blocker`` names what stands in the way otherwise.
- ``comfy``: ComfyUI's own forward through ``BaseModel.apply_model`` (``ComfyChunkModel``), its
  attention routed into FAST-AR by what ``patch_model`` adds to a ``ModelPatcher.clone()``, inert
  outside a rollout: a keyed ``DIFFUSION_MODEL`` wrapper (the chunk's temporal RoPE offset, a count of
  the forward's attention calls) and an ``optimized_attention_override`` (self-attention through the
  rollout's KV cache, cross-attention through its prompt path), chained to any override already set.

``sample`` runs a whole rollout the way KSampler does (conditioning through the model's
``extra_conds``, ComfyUI's model management, the model's latent format); ``ARVideoSampler`` runs it
as the SAMPLER of core ComfyUI's autoregressive video graph.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.model_sampling
import comfy.patcher_extension
import comfy.sampler_helpers
import comfy.samplers
import comfy.utils

from ..fastar import CacheConfig, FastARError, FlowMatchSchedule, Rollout, TempCacheConfig
from ..fastar.frames import video_frames
from ..kernels.fp8_linear import scaled_mm_runs

WRAPPER_KEY = "fastar"            # key of our DIFFUSION_MODEL wrapper
STATE_KEY = "fastar_rollout"      # transformer_options key present only inside a rollout
CALL_KEY = "fastar_forward"       # per-forward attention bookkeeping (set by the wrapper)
SETTINGS_KEY = "fastar"           # model_options key holding the Patch Model node's settings

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


@functools.lru_cache(maxsize=None)
def _rope_reads_options(cls) -> bool:
    """Newer ComfyUI's ``rope_encode`` reads ``transformer_options["rope_options"]``; older takes only t_start."""
    return "transformer_options" in inspect.signature(cls.rope_encode).parameters


# -- patching -----------------------------------------------------------------------------
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


def patch_model(model, settings: dict | None = None, node: str = "FAST-AR Patch Model"):
    """A clone of ``model`` routed through FAST-AR during rollouts; ``model`` is not modified.
    ``settings``: the rollout's ``cache`` (a ``CacheConfig`` / ``TempCacheConfig``) and ``ann``."""
    wan_diffusion_model(model, node)
    m = model.clone()
    m.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, _diffusion_model_wrapper)
    options = m.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    if hasattr(previous, "fastar_previous"):  # re-patching: chain to what was there before us
        previous = previous.fastar_previous
    options["optimized_attention_override"] = _make_attention_override(previous)
    m.model_options[SETTINGS_KEY] = dict(settings or {})
    return m


# -- the chunk model ----------------------------------------------------------------------
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

    def __init__(self, model, transformer_options: dict | None = None):
        self.patcher = model
        self.base = model.model
        self.dm = wan_diffusion_model(model)
        ms = self.base.model_sampling
        if not (hasattr(ms, "multiplier") and isinstance(ms, comfy.model_sampling.CONST)):
            raise FastARError(f"FAST-AR needs a flow-matching model; this one samples with {type(ms).__name__}")
        self.multiplier = float(ms.multiplier)
        options = transformer_options if transformer_options is not None else \
            _transformer_options(model, model.model_options)
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
        self.latent_channels, self.text_dim, self.patch_size = dm.in_dim, dm.text_dim, tuple(dm.patch_size)
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


# -- the engine ---------------------------------------------------------------------------
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STORED_DTYPES = _COMPUTE_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)
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


def compute_dtype(patcher) -> torch.dtype:
    """The dtype ComfyUI computes the model in: its weights' dtype, or the one it casts them to."""
    return patcher.model.manual_cast_dtype or patcher.model.get_dtype()


def _fused_blocker(patcher, dm, options: dict, model_options: dict) -> str | None:
    """Why the fused forward would not compute what ComfyUI's forward computes, or None."""
    ms = patcher.model.model_sampling
    if not isinstance(ms, comfy.model_sampling.CONST) or float(getattr(ms, "multiplier", 0.0)) != 1000.0:
        return f"the model samples with {type(ms).__name__} (multiplier {getattr(ms, 'multiplier', '?')})"
    if compute_dtype(patcher) not in _COMPUTE_DTYPES:
        return f"it computes in {compute_dtype(patcher)}"
    device = torch.device(patcher.load_device)
    for name, p in dm.named_parameters():
        if p.device != device or p.device.type == "meta":
            return f"its weights are not all on {device} ({name} is on {p.device}: offloaded or partly loaded)"
        if p.dtype not in _STORED_DTYPES:
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


class _CastOnRead:
    """A layer whose ``weight`` and ``bias`` are read in ``compute_dtype``, as ComfyUI's cast ops read
    weights stored in another dtype (fp8 among them): the stored tensors stay the model's own, and each
    forward dequantizes a layer's weight when it uses it."""

    @property
    def weight(self):
        return self._parameters["weight"].to(self.compute_dtype)

    @property
    def bias(self):
        b = self._parameters.get("bias")
        return None if b is None else b.to(self.compute_dtype)


_CAST_CLASSES: dict = {}


def _cast_on_read(module: torch.nn.Module, dtype: torch.dtype) -> None:
    cls = type(module)
    if cls not in _CAST_CLASSES:
        _CAST_CLASSES[cls] = type(f"CastOnRead{cls.__name__}", (_CastOnRead, cls), {})
    module.__class__ = _CAST_CLASSES[cls]
    module.compute_dtype = dtype


def _fp8_matmuls(wan, dtype: torch.dtype) -> bool:
    """Whether the blocks' linear layers can run on fp8 tensor cores (``kernels.fp8_linear.scaled_mm_runs``:
    weights on a CUDA device of compute capability 8.9 on, computing in bf16 / fp16)."""
    w = wan.blocks[0].ffn[0].weight
    return scaled_mm_runs(w, w.shape[1], w.shape[0], dtype)


def fused_wan(dm, dtype: torch.dtype | None = None, *, fp8_linears: bool = False):
    """The library's Wan forward over ``dm``'s own parameter tensors (no copy: the state-dict names
    match), computing in ``dtype`` (default: the weights'). Weights stored in another dtype are read
    in ``dtype`` layer by layer; the patch embedding runs in its own dtype, as ComfyUI runs it (fp32).
    ``fp8_linears`` (where fp8 matmuls run, ``_fp8_matmuls``) runs the blocks' linear layers as
    ``Fp8Linear``: those stored in float8_e4m3fn (Load Diffusion Model's fp8_e4m3fn) over that very
    tensor (scale 1) instead of dequantized on every forward, those stored in a compute dtype through a
    per-channel scaled e4m3 copy per rollout (half their bytes). Opt-in either way: each layer's input
    is quantized too (a few % of its output in error), which pays in time at the 14B's shapes and not
    at the 1.3B's (bench/NOTES.md). Built per rollout: ComfyUI swaps a parameter's tensor when it
    patches or moves weights."""
    from ..fastar.models import Fp8Linear, WanModel, infer_config
    from ..fastar.models import fp8_linears as with_fp8_linears

    state = dict(dm.state_dict())
    config = infer_config(state, num_heads=int(dm.num_heads))
    eps = float(getattr(dm, "eps", config.eps))
    config = dataclasses.replace(config, eps=eps, text_len=int(getattr(dm, "text_len", config.text_len)))
    with torch.device("meta"):
        wan = WanModel(config)
    wan.load_state_dict(state, strict=True, assign=True)
    dtype = dtype or state["blocks.0.self_attn.q.weight"].dtype
    if fp8_linears and not _fp8_matmuls(wan, dtype):
        logging.warning("FAST-AR: fp8_linears needs a GPU with fp8 tensor cores (compute capability 8.9 on) and a "
                        "bf16 / fp16 model; the linear layers run in %s", dtype)
    elif fp8_linears:
        wan = with_fp8_linears(wan, lambda name, linear: linear.weight.dtype in (torch.float8_e4m3fn,
                                                                                 *_COMPUTE_DTYPES))
    for name, m in wan.named_modules():
        if isinstance(m, Fp8Linear):  # reads its own weight and bias
            continue
        stored = [p.dtype for p in m.parameters(recurse=False)]
        own_dtype = name == "patch_embedding" and all(d in _COMPUTE_DTYPES for d in stored)
        if "weight" in m._parameters and not own_dtype and any(d != dtype for d in stored):
            _cast_on_read(m, dtype)
    return wan.eval().requires_grad_(False)


def choose_engine(patcher, options: dict, model_options: dict, node: str) -> Engine:
    """The fused engine wherever it computes what ComfyUI's forward would; ComfyUI's own otherwise."""
    dm = wan_diffusion_model(patcher, node)
    reason = _fused_blocker(patcher, dm, options, model_options)
    if reason is None:
        try:
            fp8 = bool(patcher.model_options.get(SETTINGS_KEY, {}).get("fp8_linears"))
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


def _transformer_options(model, model_options: dict, prepared: bool = False) -> dict:
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


# -- conditioning -------------------------------------------------------------------------
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


def video_frame(latent: int) -> int:
    """The first video frame a latent frame decodes to: the count of video frames the ones before it
    decode to (Wan's causal VAE: 1, then 4 per latent frame)."""
    return video_frames(latent)


def schedule_chunks(starts: list[int], frames: int, chunk_frames: int, node: str) -> list[int]:
    """The chunk each scheduled prompt after the first starts at: the first chunk all of whose video
    frames come at or after the prompt's start frame, so every frame before it keeps the earlier prompt."""
    last_frame = video_frames(frames) - 1  # the last video frame of ``frames`` latent frames
    chunks = []
    for i, start in enumerate(starts[1:], 2):
        if start > last_frame:
            raise FastARError(f"{node}: FAST-AR Prompt Schedule's prompt {i} starts at frame {start}, past the "
                              f"video's end (its last frame is {last_frame})")
        first_latent = -(-(start + 3) // 4)  # the first latent frame whose video frames all come at or after start
        chunk = -(-first_latent // chunk_frames)
        if chunk * chunk_frames >= frames:
            raise FastARError(f"{node}: FAST-AR Prompt Schedule's prompt {i} starts at frame {start}, inside the "
                              f"last chunk; the last a prompt can start at is frame "
                              f"{video_frame((frames // chunk_frames - 1) * chunk_frames)}")
        if chunks and chunk == chunks[-1]:
            raise FastARError(f"{node}: FAST-AR Prompt Schedule's prompts {i - 1} and {i} both start with the "
                              f"chunk at frame {video_frame(chunk * chunk_frames)}: start them at least one chunk "
                              f"({4 * chunk_frames} frames) apart")
        chunks.append(chunk)
    return chunks


def scheduled_contexts(model, schedule, noise: torch.Tensor, device, frames: int, chunk_frames: int,
                       node: str) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """A FAST-AR Prompt Schedule as the rollout's first context and its (chunk, context) switches;
    logs where each prompt starts (a chunk's first frame, at or after the asked one)."""
    chunks = schedule_chunks([start for start, _ in schedule], frames, chunk_frames, node)
    contexts = [conditioning_context(model, cond, noise, device, node, f"prompt schedule's prompt {i}")
                for i, (_, cond) in enumerate(schedule, 1)]
    starts = "".join(f"; prompt {i} from frame {video_frame(c * chunk_frames)} (asked {start})"
                     for i, (c, (start, _)) in enumerate(zip(chunks, schedule[1:]), 2))
    logging.info("%s: the prompt schedule conditions the video (positive is not used)%s", node, starts)
    return contexts[0], list(zip(chunks, contexts[1:]))


def _texts(patcher, prompts, positive, negative, encode: Callable, noise: torch.Tensor, device, frames: int,
           chunk_frames: int, node: str):
    """(first context, [(chunk, context)] prompt switches, negative context or None) at one token count.
    A prompt schedule conditions the video instead of ``positive``; ``encode(conditioning, name)`` turns
    the sampler's own positive / negative into a context."""
    switches = []
    if prompts:
        context, switches = scheduled_contexts(patcher, prompts, noise, device, frames, chunk_frames, node)
    else:
        context = encode(positive, "positive")
    negative = None if negative is None else encode(negative, "negative")
    n = 1 + len(switches)
    texts = _match_tokens(context, *(t for _, t in switches), *([] if negative is None else [negative]))
    return texts[0], [(c, t) for (c, _), t in zip(switches, texts[1:n])], None if negative is None else texts[n]


def _rollout(patcher, options: dict, model_options: dict, texts, device, node: str,
             on_engine: Callable[[Engine], None] | None, ann, **settings) -> Rollout:
    """The rollout over ``texts`` (``_texts``) on the engine ``choose_engine`` picks; ``settings``: the
    rest of ``Rollout``'s keywords, which differ between the two samplers."""
    context, switches, negative = texts
    engine = choose_engine(patcher, options, model_options, node)
    if on_engine is not None:
        on_engine(engine)
    if engine.name == "comfy":
        engine.model.cond_or_uncond = [0, 1] if negative is not None else [0]
    rollout = Rollout(engine.model, context.to(device),
                      negative_context=None if negative is None else negative.to(device),
                      prompts=[(c, t.to(device)) for c, t in switches],
                      ann=ann, **settings)
    log_engine(engine, node, rollout.device, rollout.cuda_graphs)
    return rollout


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


def check_cache(cache, ann, chunk_frames: int, node: str) -> None:
    """The cache and sparsity settings that cannot run together, named as the graph shows them."""
    if ann is not None and ann.annsa and not isinstance(cache, TempCacheConfig) and cache.mode == "window":
        raise FastARError(f"{node}: ANN Sparsity's annsa reads a bucket-sorted cache, which a Sink + Window Cache "
                          f"does not keep (its frames are a ring); connect TempCache Settings to FAST-AR Patch "
                          f"Model's cache, turn the window cache's unbounded on, or set ANN Sparsity's annsa to false")
    if isinstance(cache, TempCacheConfig) and cache.history_frames < chunk_frames:
        raise FastARError(f"{node}: TempCache Settings' max_cache_frames {cache.max_cache_frames} leaves "
                          f"{cache.history_frames} frames beside its {cache.sink_frames} sink frames, less than one "
                          f"chunk of {chunk_frames}; set max_cache_frames to at least "
                          f"{cache.sink_frames + chunk_frames}")


# -- a whole rollout, the way KSampler runs a sampler ------------------------------------------
@dataclass
class SampleSettings:
    width: int
    height: int
    frames: int                 # latent frames (a last chunk that is not whole is generated whole, then cut)
    batch_size: int = 1
    seed: int = 0
    timesteps: str = "1000,750,500,250"
    shift: float = 5.0
    chunk_frames: int = 3
    context_noise: float = 0.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    cfg: float = 1.0
    ann: object | None = None   # a fastar AnnConfig (AnnSA / AnnCA sparsity); None: dense attention
    prompts: list | None = None  # FAST-AR Prompt Schedule's [(start video frame, CONDITIONING)]; None: positive


def sample(model, positive, negative, settings: SampleSettings, on_chunk: Callable | None = None,
           preview: bool = True, on_engine: Callable[[Engine], None] | None = None,
           node: str = "Autoregressive Long Sampler") -> dict:
    """Run a FAST-AR rollout on a ComfyUI MODEL; returns a LATENT dict (samples in the VAE's space).

    Runs under ``torch.inference_mode()`` however it is called (ComfyUI's executor does the same):
    a rollout never needs autograd, and with it on every chunk's activations would be kept."""
    with torch.inference_mode():
        return _sample(model, positive, negative, settings, on_chunk, preview, on_engine, node)


def _sample(model, positive, negative, settings, on_chunk, preview, on_engine, node) -> dict:
    if not is_patched(model):
        model = patch_model(model)
    schedule = FlowMatchSchedule.parse(settings.timesteps, shift=settings.shift)
    device = model.load_device
    guided = settings.cfg != 1.0
    if guided and negative is None:
        raise FastARError(f"{node}: cfg={settings.cfg} needs a negative prompt; connect one or set cfg to 1")
    check_cache(settings.cache, settings.ann, settings.chunk_frames, node)
    warn_if_not_causal(model, node)
    whole = -(-settings.frames // settings.chunk_frames) * settings.chunk_frames
    latent_shape = (settings.batch_size, model.model.latent_format.latent_channels, whole,
                    settings.height // 8, settings.width // 8)
    noise_like = torch.zeros(latent_shape)
    conds = {"positive": comfy.sampler_helpers.convert_cond(positive)}
    if guided:
        conds["negative"] = comfy.sampler_helpers.convert_cond(negative)

    model_options = comfy.model_patcher.create_model_options_clone(model.model_options)
    comfy.sampler_helpers.prepare_model_patcher(model, conds, model_options)
    real_model, _, loaded = comfy.sampler_helpers.prepare_sampling(model, latent_shape, conds, model_options)
    rollout = None
    try:
        model.pre_run()
        texts = _texts(model, settings.prompts, positive, negative if guided else None,
                       lambda c, name: conditioning_context(model, c, noise_like, device, node, name),
                       noise_like, device, whole, settings.chunk_frames, node)
        rollout = _rollout(model, _transformer_options(model, model_options, prepared=True), model_options, texts,
                           device, node, on_engine, settings.ann, frames=whole, height=settings.height,
                           width=settings.width, chunk_frames=settings.chunk_frames, schedule=schedule,
                           cache=settings.cache, seed=settings.seed, context_noise=settings.context_noise,
                           cfg=settings.cfg)
        progress = ChunkProgress(model, rollout.num_chunks, preview)

        def report(r):
            progress(r)
            if on_chunk is not None:
                on_chunk(r)
            # Cancel from the UI: stop here, between chunks; the finally below frees the cache.
            comfy.model_management.throw_exception_if_processing_interrupted()

        samples = rollout.run(report)[:, :, :settings.frames]
        samples = real_model.process_latent_out(samples.to(torch.float32))
        return {"samples": samples.to(comfy.model_management.intermediate_device())}
    finally:
        del rollout
        model.cleanup()
        comfy.sampler_helpers.cleanup_models(conds, loaded)
        comfy.model_management.soft_empty_cache()


# -- core's autoregressive graph: a SAMPLER for SamplerCustom / SamplerCustomAdvanced -------------
def _graph_noise(x: torch.Tensor, seed: int, chunk_frames: int) -> Callable:
    """Noise as core's ``sample_ar_video`` draws it: a chunk starts from the graph's noisy latent, and
    the re-noise after step i of chunk c comes from ``torch.manual_seed(seed + 1000 * c + i)``."""
    def noise(c, s, shape, device, out=None):
        if s == 0:
            n = x[:, :, c * chunk_frames:(c + 1) * chunk_frames]
        else:
            torch.manual_seed(seed + c * 1000 + s - 1)
            n = torch.randn(shape, device=device)
        if out is None:
            return n.to(device=device, dtype=torch.float32).clone()
        return out.copy_(n)
    return noise


class ARVideoSampler(comfy.samplers.Sampler):
    """FAST-AR's rollout as the SAMPLER of core's autoregressive video graph (where ``SamplerARVideo``
    sits): the graph's noise, sigmas and seed, chunks of ``chunk_frames`` latent frames, and the cache and
    sparsity of FAST-AR Patch Model's settings on the model (TempCache at its defaults without)."""

    node = "FAST-AR AR Video"

    def __init__(self, chunk_frames: int, events=None, prompts: list | None = None):
        """``events``: gets ``start(frames, chunks, prompts)``, ``engine(Engine)``, a ``ChunkReport`` per
        chunk (called) and ``finish("done" | "stopped")`` (the cache widget's ``CacheEvents``).
        ``prompts``: a FAST-AR Prompt Schedule, which then conditions the video instead of the graph's
        positive."""
        self.chunk_frames, self.events, self.prompts = int(chunk_frames), events, prompts

    def sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        with torch.inference_mode():
            try:
                out = self._sample(model_wrap, sigmas, extra_args, callback, noise, latent_image, denoise_mask)
            except BaseException:
                if self.events is not None:
                    self.events.finish("stopped")
                raise
        if self.events is not None:
            self.events.finish("done")
        return out

    def _check(self, sigmas, noise, denoise_mask, options) -> list[float]:
        node = self.node
        if noise.ndim != 5:
            raise FastARError(f"{node}: the latent must be a video latent [B, C, T, H, W] (Empty AR Video Latent), "
                              f"got {list(noise.shape)}")
        if denoise_mask is not None:
            raise FastARError(f"{node}: a latent noise mask is not supported by the autoregressive sampler")
        if (options.get("ar_config") or {}).get("initial_latent") is not None:
            raise FastARError(f"{node}: image-to-video (AR Video I2V's start image) is not supported yet; "
                              f"use Sampler AR Video for it")
        s = [float(v) for v in sigmas]
        if len(s) < 2 or s[-1] != 0.0 or any(a <= b for a, b in zip(s, s[1:])) or s[0] > 1.0:
            raise FastARError(f"{node}: sigmas must fall strictly from at most 1 to 0 (a full denoise), got "
                              f"{[round(v, 4) for v in s]}")
        frames = noise.shape[2]
        if frames % self.chunk_frames:
            lo, hi = (frames // self.chunk_frames) * self.chunk_frames, (frames // self.chunk_frames + 1) * self.chunk_frames
            lengths = [video_frames(n) for n in (lo, hi) if n >= 1]
            raise FastARError(f"{node}: the latent has {frames} frames, not a multiple of num_frame_per_block "
                              f"{self.chunk_frames}; set Empty AR Video Latent's length to "
                              f"{' or '.join(map(str, lengths))}")
        return s[:-1]

    def _sample(self, model_wrap, sigmas, extra_args, callback, noise, latent_image, denoise_mask):
        patcher, base, node = model_wrap.model_patcher, model_wrap.inner_model, self.node
        model_options = extra_args.get("model_options", {})
        options = _transformer_options(patcher, model_options, prepared=True)
        steps = self._check(sigmas, noise, denoise_mask, options)
        settings = patcher.model_options.get(SETTINGS_KEY, {})
        cache = settings.get("cache") or TempCacheConfig()
        check_cache(cache, settings.get("ann"), self.chunk_frames, node)
        warn_if_not_causal(patcher, node)
        device, batch, seed = patcher.load_device, noise.shape[0], int(extra_args.get("seed", 0))
        if latent_image is None:
            latent_image = torch.zeros_like(noise)
        x = base.model_sampling.noise_scaling(sigmas[0], noise, latent_image, self.max_denoise(model_wrap, sigmas))
        frames, (h, w) = x.shape[2], x.shape[3:]
        cfg = float(getattr(model_wrap, "cfg", 1.0))
        negative = model_wrap.conds.get("negative") if cfg != 1.0 else None
        if not negative:  # nothing to guide with: unguided
            negative, cfg = None, 1.0
        texts = _texts(patcher, self.prompts, model_wrap.conds.get("positive"), negative,
                       lambda conds, name: text_context(conds, batch, device, node, name),
                       torch.zeros_like(noise), device, frames, self.chunk_frames, node)
        if self.events is not None:
            self.events.start(frames, frames // self.chunk_frames, 1 + len(texts[1]))
        rollout = _rollout(patcher, options, model_options, texts, device, node,
                           None if self.events is None else self.events.engine, settings.get("ann"),
                           frames=frames, height=h * 8, width=w * 8, chunk_frames=self.chunk_frames,
                           schedule=FlowMatchSchedule.from_sigmas(steps), cache=cache, seed=seed, cfg=cfg,
                           noise=_graph_noise(x.to(device), seed, self.chunk_frames))
        done = torch.zeros_like(x)
        total = len(sigmas) - 1

        def report(r):
            start = r.frames_done - r.latent.shape[2]
            done[:, :, start:r.frames_done] = r.latent.to(done)
            if callback is not None:
                callback(max((r.chunk + 1) * total // r.num_chunks - 1, 0), done, done, total)
            if self.events is not None:
                self.events(r)
            comfy.model_management.throw_exception_if_processing_interrupted()

        try:
            out = rollout.run(report)
        finally:
            del rollout
        return base.model_sampling.inverse_noise_scaling(sigmas[-1], out.to(x))


# -- UI glue ----------------------------------------------------------------------------
def comfy_module(name: str):
    """A module of ComfyUI's top level: ``name`` in a checkout, ``comfy.cmd.name`` in the pip-installable
    ComfyUI."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return importlib.import_module(f"comfy.cmd.{name}")


class ChunkProgress:
    """ComfyUI progress bar per chunk, with a preview of the chunk's last frame."""

    def __init__(self, model, num_chunks: int, preview: bool):
        self.pbar = comfy.utils.ProgressBar(num_chunks)
        self.num_chunks = num_chunks
        self.previewer = None
        if preview:
            try:  # previews are best effort; never fail a run over one
                lp = comfy_module("latent_preview")
                self.previewer = lp.get_previewer(model.load_device, model.model.latent_format)
            except Exception:
                self.previewer = None

    def __call__(self, report):
        image = None
        if self.previewer is not None:
            try:
                image = self.previewer.decode_latent_to_preview_image("JPEG", report.latent[:, :, -1:])
            except Exception:
                image = None
        self.pbar.update_absolute(report.chunk + 1, self.num_chunks, image)


def prompt_server():
    """ComfyUI's PromptServer instance, or None outside a running server."""
    for name in ("server", "comfy.cmd.server"):
        try:
            module = __import__(name, fromlist=["PromptServer"])
            instance = getattr(module.PromptServer, "instance", None)
            if instance is not None:
                return instance
        except Exception:
            continue
    return None


def send_event(event: str, data: dict) -> None:
    server = prompt_server()
    if server is not None:
        server.send_sync(event, data, server.client_id)
