"""The blocks' linear layers as fp8 matmuls: ``Fp8Linear`` (per-token x per-channel scaled e4m3 on fp8
tensor cores, ``kernels.fp8_linear``) and ``fp8_linears``, a Wan model's blocks moved onto it."""
from __future__ import annotations

import copy
import itertools
from typing import Callable

import torch
from torch import nn

from ...kernels.fp8_linear import fp8_linear_auto, fp8_matmul_auto, quantize_weight
from ..errors import FastARError


class Fp8Linear(nn.Module):
    """A linear layer on fp8 tensor cores (``kernels.fp8_linear``): ``weight`` is float8 e4m3 [N, K]
    with ``weight_scale`` [1, N] fp32 per output channel, and each input row is quantized to e4m3
    with a scale of its own as the layer runs. The parameter names are nn.Linear's (``weight``,
    ``bias``), so the layer sits under the checkpoint's names; the scale is a buffer beside them.
    The bias stays in its own dtype and is read in the input's."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
            raise FastARError(f"Fp8Linear: weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                              f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        as_param = (lambda t: t if t is None or isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False))
        self.weight = as_param(weight)
        self.register_parameter("bias", as_param(bias))
        self.register_buffer("weight_scale", weight_scale)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, scale: torch.Tensor | float | None = None) -> "Fp8Linear":
        """The layer of ``linear``'s weight: an e4m3 weight taken as it is (its own tensor, with
        ``scale``: 1 by default), any other quantized per output channel (``quantize_weight``); the
        bias is ``linear``'s own tensor."""
        weight = linear._parameters["weight"]
        weight8, weight_scale = quantize_weight(weight, scale)
        return cls(weight if weight8 is weight else weight8, weight_scale, linear._parameters.get("bias"))

    def forward(self, x: torch.Tensor, *, gelu_input: bool = False, out: torch.Tensor | None = None,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype, into ``out`` where given. ``gelu_input``: x is the
        pre-activation, put through tanh GELU as it is quantized. ``rows``: x's rows already quantized
        (``quantize_rows_auto(x.reshape(-1, K))``), shared by layers that read the same x."""
        if rows is None:
            return fp8_linear_auto(x, self.weight, self.weight_scale, self.bias, gelu_input=gelu_input, out=out)
        y = fp8_matmul_auto(*rows, self.weight, self.weight_scale, self.bias, out_dtype=x.dtype,
                            out=None if out is None else out.view(-1, self.out_features))
        return out if out is not None else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


#: The blocks' linear layers ``fp8_linears`` moves to fp8, by their names in a block. The cross-attention's
#: k and v are not among them: they project the text once per rollout (``WanModel.cross_kv``), a cost that
#: does not grow with the video, and fp8 there would only add its rounding to every step's attention.
FP8_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o",
               "ffn.0", "ffn.2")


@torch.no_grad()
def fp8_linears(model: nn.Module, which: Callable[[str, nn.Linear], bool] | None = None) -> nn.Module:
    """``model`` (a ``WanModel``) with its blocks' linear layers (``FP8_LINEARS``, those ``which(name, linear)`` picks;
    default all) as ``Fp8Linear``: per-token x per-channel scaled e4m3 matmuls, about twice the bf16
    rate on Hopper, at an error of a few % of each layer's output. A new module tree over the same
    tensors: every other parameter and buffer is ``model``'s own, e4m3 weights are taken as they are,
    other weights are quantized (a byte a weight and a scale a channel: the only new tensors; the
    originals stay ``model``'s alone), and ``model`` is left as it was. The quantized layers run on fp8 tensor cores
    where ``torch._scaled_mm`` runs (CUDA, compute capability 8.9 on, bf16 / fp16), else through
    ``kernels.fp8_linear``'s twins, which compute the same numbers slower."""
    own = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    fp8 = copy.deepcopy(model, own)  # the modules copied; their tensors, found in the memo, shared
    for block in fp8.blocks:
        for name in FP8_LINEARS:
            parent, _, attr = name.rpartition(".")
            parent = getattr(block, parent)
            linear = getattr(parent, attr, None)  # a block without cross-attention has none
            if isinstance(linear, nn.Linear) and (which is None or which(name, linear)):
                setattr(parent, attr, Fp8Linear.from_linear(linear))
    return fp8
