"""The fused engine's forward: the library's Wan 2.1 model (``fastar.models.WanModel``) over a ComfyUI
model's own parameter tensors, no second copy of the weights, each read in the dtype ComfyUI computes in."""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..kernels.fp8_linear import scaled_mm_runs

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STORED_DTYPES = COMPUTE_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


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
    at the 1.3B's. Built per rollout: ComfyUI swaps a parameter's tensor when it
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
                                                                                 *COMPUTE_DTYPES))
    for name, m in wan.named_modules():
        if isinstance(m, Fp8Linear):  # reads its own weight and bias
            continue
        stored = [p.dtype for p in m.parameters(recurse=False)]
        own_dtype = name == "patch_embedding" and all(d in COMPUTE_DTYPES for d in stored)
        if "weight" in m._parameters and not own_dtype and any(d != dtype for d in stored):
            _cast_on_read(m, dtype)
    return wan.eval().requires_grad_(False)

