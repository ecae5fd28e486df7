"""The bridge between ComfyUI and ``fastar``: the only module that touches ComfyUI internals.

``patch_model`` returns a ``ModelPatcher.clone()`` of a stock Wan 2.1 T2V model with two
additions, both inert unless a FAST-AR rollout is running:

- a keyed ``DIFFUSION_MODEL`` wrapper that, inside a rollout, gives the chunk its temporal RoPE
  offset (``transformer_options["rope_options"]["shift_t"]`` where ``rope_encode`` reads it,
  otherwise ``rope_encode(..., t_start=)`` for the duration of the call) and counts the
  forward's attention calls;
- an ``optimized_attention_override`` that, inside a rollout, sends self-attention through the
  rollout's KV cache (``fastar.FastARAttention``) and cross-attention to its prompt path. Any
  override that was already set (SageAttention patches, ...) is kept and called for every call
  that is not ours.

``ComfyChunkModel`` makes such a patched model follow ``fastar.ChunkModel``: each chunk forward
goes through ``BaseModel.apply_model`` (input scaling, weight dtype, LoRA/weight patches, model
wrappers) the way ComfyUI's samplers call it. ``sample`` runs a whole rollout the way KSampler
does: conditioning through the model's ``extra_conds``, models loaded by ComfyUI's model
management, latents in and out through the model's latent format.
"""
from __future__ import annotations

import functools
import inspect
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

from ..fastar import CacheConfig, FastARError, FlowMatchSchedule, Rollout

WRAPPER_KEY = "fastar"            # key of our DIFFUSION_MODEL wrapper
STATE_KEY = "fastar_rollout"      # transformer_options key present only inside a rollout
CALL_KEY = "fastar_forward"       # per-forward attention bookkeeping (set by the wrapper)
SETTINGS_KEY = "fastar"           # model_options key holding the Patch Model node's settings

_WAN_CLASSES = ("WanModel", "CausalWanModel")


# -- model checks -------------------------------------------------------------------------
def wan_diffusion_model(model):
    """The stock Wan 2.1 T2V DiT inside a ComfyUI MODEL, or one clear error naming what it is."""
    base = getattr(model, "model", None)
    dm = getattr(base, "diffusion_model", None)
    what = type(dm).__name__ if dm is not None else type(base if base is not None else model).__name__
    family = type(base).__name__ if base is not None else type(model).__name__
    try:
        from comfy.ldm.wan.model import WanModel
    except ImportError:  # pragma: no cover - every supported ComfyUI has it
        WanModel = None
    ok = (WanModel is not None and isinstance(dm, WanModel) and type(dm).__name__ in _WAN_CLASSES
          and getattr(dm, "model_type", None) == "t2v")
    if not ok:
        detail = f"{family} / {what}"
        if WanModel is not None and isinstance(dm, WanModel):
            detail += f" (model_type={getattr(dm, 'model_type', '?')!r})"
        raise FastARError(f"FAST-AR needs a Wan 2.1 text-to-video diffusion model (a causal Wan 2.1 checkpoint "
                          f"loaded with Load Diffusion Model); the MODEL connected is {detail}")
    if tuple(dm.patch_size)[0] != 1:
        raise FastARError(f"FAST-AR needs a temporal patch size of 1, the model has {tuple(dm.patch_size)}")
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


def patch_model(model, settings: dict | None = None):
    """A clone of ``model`` routed through FAST-AR during rollouts; ``model`` is not modified."""
    wan_diffusion_model(model)
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
        self.transformer_options = options
        self.cond_or_uncond = [0]

    # ChunkModel geometry
    @property
    def num_layers(self) -> int:
        return len(self.dm.blocks)

    @property
    def num_heads(self) -> int:
        return self.dm.num_heads

    @property
    def head_dim(self) -> int:
        return self.dm.dim // self.dm.num_heads

    @property
    def latent_channels(self) -> int:
        return self.dm.in_dim

    @property
    def text_dim(self) -> int:
        return self.dm.text_dim

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.dm.patch_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.base.manual_cast_dtype or self.base.get_dtype()

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
def conditioning_context(model, conditioning, noise: torch.Tensor, device, name: str) -> torch.Tensor:
    """A ComfyUI CONDITIONING (one prompt) as the model's ``context`` [B, tokens, text_dim],
    through the model's own ``extra_conds`` as ComfyUI's samplers compute it."""
    if not isinstance(conditioning, list) or len(conditioning) != 1:
        n = len(conditioning) if isinstance(conditioning, list) else type(conditioning).__name__
        raise FastARError(f"{name}: the autoregressive sampler takes one prompt (a single conditioning entry), "
                          f"got {n}; combined or area conditioning is not supported")
    conds = comfy.sampler_helpers.convert_cond(conditioning)
    conds = comfy.samplers.encode_model_conds(model.model.extra_conds, conds, noise, device, name)
    model_conds = conds[0]["model_conds"]
    unsupported = sorted(k for k in model_conds if k != "c_crossattn")
    if unsupported:
        raise FastARError(f"{name}: conditioning carries {', '.join(unsupported)}, which the text-to-video "
                          f"autoregressive sampler does not use")
    if "c_crossattn" not in model_conds:
        raise FastARError(f"{name}: conditioning has no text embedding")
    return model_conds["c_crossattn"].process_cond(batch_size=noise.shape[0], device=device).cond


def _match_tokens(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat two prompt embeddings to a common token count (attention over a sequence repeated
    n times equals attention over the sequence: the weights split evenly over the copies)."""
    la, lb = a.shape[1], b.shape[1]
    if la == lb:
        return a, b
    n = math.lcm(la, lb)
    return a.repeat(1, n // la, 1), b.repeat(1, n // lb, 1)


# -- a whole rollout, the way KSampler runs a sampler ------------------------------------------
@dataclass
class SampleSettings:
    width: int
    height: int
    frames: int                 # latent frames
    batch_size: int = 1
    seed: int = 0
    timesteps: str = "1000,750,500,250"
    shift: float = 5.0
    chunk_frames: int = 3
    context_noise: float = 0.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    cfg: float = 1.0
    ann: object | None = None   # a fastar AnnConfig (AnnSA / AnnCA sparsity); None: dense attention


def latent_frames(video_frames: int) -> int:
    """Wan's causal VAE: 1 + 4k video frames become 1 + k latent frames."""
    return (video_frames - 1) // 4 + 1


def sample(model, positive, negative, settings: SampleSettings,
           on_chunk: Callable | None = None, preview: bool = True) -> dict:
    """Run a FAST-AR rollout on a ComfyUI MODEL; returns a LATENT dict (samples in the VAE's space)."""
    if not is_patched(model):
        model = patch_model(model)
    schedule = FlowMatchSchedule.parse(settings.timesteps, shift=settings.shift)
    device = model.load_device
    guided = settings.cfg != 1.0
    if guided and negative is None:
        raise FastARError(f"cfg={settings.cfg} needs a negative prompt; connect one or set cfg to 1")
    b = settings.batch_size
    latent_shape = (b, model.model.latent_format.latent_channels, settings.frames,
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
        context = conditioning_context(model, positive, noise_like, device, "positive")
        negative_context = None
        if guided:
            negative_context = conditioning_context(model, negative, noise_like, device, "negative")
            context, negative_context = _match_tokens(context, negative_context)
        chunk_model = ComfyChunkModel(model, _transformer_options(model, model_options, prepared=True))
        chunk_model.cond_or_uncond = [0, 1] if guided else [0]
        rollout = Rollout(chunk_model, context.to(device), frames=settings.frames, height=settings.height,
                          width=settings.width, chunk_frames=settings.chunk_frames, schedule=schedule,
                          cache=settings.cache, seed=settings.seed, context_noise=settings.context_noise,
                          negative_context=None if negative_context is None else negative_context.to(device),
                          cfg=settings.cfg, **({"ann": settings.ann} if settings.ann is not None else {}))
        progress = ChunkProgress(model, rollout.num_chunks, preview)

        def report(r):
            progress(r)
            if on_chunk is not None:
                on_chunk(r)
            # Cancel from the UI: stop here, between chunks; the finally below frees the cache.
            comfy.model_management.throw_exception_if_processing_interrupted()

        samples = rollout.run(report)
        samples = real_model.process_latent_out(samples.to(torch.float32))
        return {"samples": samples.to(comfy.model_management.intermediate_device())}
    finally:
        del rollout
        model.cleanup()
        comfy.sampler_helpers.cleanup_models(conds, loaded)
        comfy.model_management.soft_empty_cache()


# -- UI glue ----------------------------------------------------------------------------
def _latent_preview_module():
    try:
        import latent_preview  # ComfyUI as a checkout
        return latent_preview
    except ImportError:
        try:
            from comfy.cmd import latent_preview  # pip-installable ComfyUI
            return latent_preview
        except ImportError:
            return None


class ChunkProgress:
    """ComfyUI progress bar per chunk, with a preview of the chunk's last frame."""

    def __init__(self, model, num_chunks: int, preview: bool):
        self.pbar = comfy.utils.ProgressBar(num_chunks)
        self.num_chunks = num_chunks
        self.previewer = None
        if preview:
            lp = _latent_preview_module()
            try:
                self.previewer = lp.get_previewer(model.load_device, model.model.latent_format) if lp else None
            except Exception:  # previews are best effort; never fail a run over one
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
