"""TempCache's group merge of a chunk's rows into history rows, as one Triton kernel launched twice.

Why: a merged slot's value becomes its group's running mean, its key the newest member's. Torch
needs a dozen gathers, copies and an ``index_add_`` with an int64 index per element.
Here the first launch writes each group's representative row (its key; the old mean's weighted
value plus its own share, in fp32), the second atomically adds the other members' shares; each
program reads its tokens' slot state itself.

Semantics (the twin defines them): for history rows ``k, v [M, H, D]`` (any strides, written in
place), the chunk's ``new_k, new_v [N, H, D]``, ``slot [H, N]`` int64 in ``[0, M)``, ``merge [H, N]``
bool, and per head and slot the old group size ``count [H, M]``, the merged arrivals ``added [H,
M]`` (fp32) and the newest arrival's token ``rep [H, M]`` int64: for every slot s of head h that a
token merges into, with ``t = count + added``, ``v[s, h] = count / t * v[s, h] + sum of new_v[n, h]
/ t`` over its members n, and ``k[s, h] = new_k[rep[h, s], h]``; other rows are untouched. The twin
sums in fp32 and rounds once; the kernel rounds the representative's row, then adds the others'
shares in the cache dtype (in unspecified order). The kernel clamps indices (no host sync).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, check_triton_runs_on, power_of_two, use_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["merge_rows", "merge_rows_auto", "merge_rows_torch"]

_ROWS = 32  # tokens per program: 32 x 128 values of one head


def _check(k: Tensor, v: Tensor, new_k: Tensor, new_v: Tensor, slot: Tensor, merge: Tensor,
           count: Tensor, added: Tensor, rep: Tensor) -> None:
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must be [M, H, D] alike, got {tuple(k.shape)} / {tuple(v.shape)}")
    m, h, d = k.shape
    n = new_k.shape[0] if new_k.ndim == 3 else -1
    if new_k.shape != new_v.shape or new_k.shape != (n, h, d):
        raise ValueError(f"new_k and new_v must be [N, H={h}, D={d}], got {tuple(new_k.shape)} / {tuple(new_v.shape)}")
    if len({k.dtype, v.dtype, new_k.dtype, new_v.dtype}) != 1:
        raise ValueError(f"k, v, new_k, new_v must share a dtype, got {k.dtype} {v.dtype} {new_k.dtype} {new_v.dtype}")
    for name, t, dtype, shape in (("slot", slot, torch.int64, (h, n)), ("merge", merge, torch.bool, (h, n)),
                                  ("count", count, torch.float32, (h, m)), ("added", added, torch.float32, (h, m)),
                                  ("rep", rep, torch.int64, (h, m))):
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)}")
        if t.device != k.device:
            raise ValueError(f"device mismatch: k on {k.device}, {name} on {t.device}")
    for name, t in (("v", v), ("new_k", new_k), ("new_v", new_v)):
        if t.device != k.device:
            raise ValueError(f"device mismatch: k on {k.device}, {name} on {t.device}")


def merge_rows_torch(k: Tensor, v: Tensor, new_k: Tensor, new_v: Tensor, slot: Tensor, merge: Tensor,
                     count: Tensor, added: Tensor, rep: Tensor) -> None:
    """Reference twin, in place, without a host sync (no boolean indexing)."""
    _check(k, v, new_k, new_v, slot, merge, count, added, rep)
    m, h, d = k.shape
    total = (count + added).clamp_min(1)
    share = merge / total.gather(1, slot)                                             # [H, N], 0 unmerged
    acc = torch.zeros(h, m, d, dtype=torch.float32, device=k.device)
    # scatter_add_, not index_put_(accumulate=True): on the CPU its sums come in a fixed order, so a
    # rollout repeats bit for bit (a replayed session's frames are its own)
    acc.scatter_add_(1, slot[..., None].expand(-1, -1, d), new_v.transpose(0, 1).float() * share[..., None])
    keep = torch.where(added > 0, count / total, 1.0)                                # [H, M]
    v.copy_((v.float() * keep.t()[..., None] + acc.transpose(0, 1)).to(v.dtype))
    newest = new_k.transpose(0, 1).gather(1, rep.clamp_min(0)[..., None].expand(-1, -1, d))  # [H, M, D]
    k.copy_(torch.where((added > 0).t()[..., None], newest.transpose(0, 1), k))


if HAS_TRITON:

    @triton.jit(do_not_specialize=["N", "M"])
    def _merge_rows_kernel(k_ptr, v_ptr, nk_ptr, nv_ptr, slot_ptr, merge_ptr, count_ptr, added_ptr, rep_ptr, N, M,
                           stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
                           stride_nkn, stride_nkh, stride_nkd, stride_nvn, stride_nvh, stride_nvd,
                           D: tl.constexpr, ROWS: tl.constexpr, REPS: tl.constexpr):
        """One program: ``ROWS`` tokens of head ``program_id(1)``. ``REPS``: write the groups'
        representatives (first launch), else add the other members' shares (second)."""
        h = tl.program_id(1).to(tl.int64)
        tok = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = tok < N
        merged = ok & (tl.load(merge_ptr + h * N + tok, mask=ok, other=0) != 0)
        s = tl.load(slot_ptr + h * N + tok, mask=ok, other=0)
        s = tl.minimum(tl.maximum(s, 0), M - 1)  # memory safety only
        state = h * M + s
        old = tl.load(count_ptr + state, mask=merged, other=0.0)
        total = tl.maximum(old + tl.load(added_ptr + state, mask=merged, other=0.0), 1.0)
        is_rep = merged & (tl.load(rep_ptr + state, mask=merged, other=-1) == tok)
        offs_d = tl.arange(0, D)
        tok64 = tok.to(tl.int64)
        new_v = tl.load(nv_ptr + tok64[:, None] * stride_nvn + h * stride_nvh + offs_d[None, :] * stride_nvd,
                        mask=merged[:, None], other=0.0).to(tl.float32)
        v_rows = v_ptr + s[:, None] * stride_vm + h * stride_vh + offs_d[None, :] * stride_vd
        if REPS:
            old_v = tl.load(v_rows, mask=is_rep[:, None], other=0.0).to(tl.float32)
            val = (old_v * old[:, None] + new_v) / total[:, None]
            tl.store(v_rows, val.to(v_ptr.dtype.element_ty), mask=is_rep[:, None])
            new_k = tl.load(nk_ptr + tok64[:, None] * stride_nkn + h * stride_nkh + offs_d[None, :] * stride_nkd,
                            mask=is_rep[:, None])
            tl.store(k_ptr + s[:, None] * stride_km + h * stride_kh + offs_d[None, :] * stride_kd, new_k,
                     mask=is_rep[:, None])
        else:
            others = merged & ~is_rep
            tl.atomic_add(v_rows, (new_v / total[:, None]).to(v_ptr.dtype.element_ty), mask=others[:, None],
                          sem="relaxed")


def merge_rows(k: Tensor, v: Tensor, new_k: Tensor, new_v: Tensor, slot: Tensor, merge: Tensor,
               count: Tensor, added: Tensor, rep: Tensor) -> None:
    """Triton kernel with the twin's contract (D a power of two; fp32, fp16 or bf16)."""
    if not HAS_TRITON:
        raise RuntimeError("merge_rows needs triton, which is not importable")
    _check(k, v, new_k, new_v, slot, merge, count, added, rep)
    m, h, d = k.shape
    if not power_of_two(d):
        raise ValueError(f"kernel needs D a power of two, got D={d}")
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"kernel adds values atomically: fp32, fp16 or bf16, got {k.dtype}")
    check_triton_runs_on(k)
    n = new_k.shape[0]
    if n == 0 or h == 0:
        return
    if m == 0:
        raise ValueError("slots into an empty history (M = 0)")
    args = (k, v, new_k, new_v, slot.contiguous(), merge.contiguous().view(torch.int8), count.contiguous(),
            added.contiguous(), rep.contiguous(), n, m, *k.stride(), *v.stride(), *new_k.stride(), *new_v.stride())
    for reps in (True, False):
        _merge_rows_kernel[(triton.cdiv(n, _ROWS), h)](*args, D=d, ROWS=_ROWS, REPS=reps, num_warps=4)


def merge_rows_auto(k: Tensor, v: Tensor, new_k: Tensor, new_v: Tensor, slot: Tensor, merge: Tensor,
                    count: Tensor, added: Tensor, rep: Tensor) -> None:
    """The kernel where Triton runs (D a power of two, a float dtype it adds atomically: Triton's CPU
    interpreter has no bf16 atomics), else the twin."""
    d = k.shape[-1] if k.ndim == 3 else 0
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if k.is_cuda else (torch.float32, torch.float16)
    fn = merge_rows if use_kernel(k, power_of_two(d) and k.dtype in dtypes) else merge_rows_torch
    fn(k, v, new_k, new_v, slot, merge, count, added, rep)
