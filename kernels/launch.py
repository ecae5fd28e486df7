"""How block-sparse attention (``kernels/block_sparse_attention.py``) is launched: tile sizes that
fit Hopper's shared memory, and which programs split their keys. Host-side arithmetic, plus one
read of a compiled kernel's resources.

Waves: a grid runs in waves of the programs the GPU holds at once, and a part-full last wave costs
about as long as a full one; splitting its items into shares shortens it. By default only the last
wave splits (splitting every item costs partials and a combine for all of them); ``num_splits``
splits every item, for launches whose programs read long ranges (the first step's dense biased
attention).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MAX_TAIL_SPLIT", "SMEM_BUDGET", "TUNABLES", "block_m", "default_launch",
           "device_wave", "launch_config", "smem_bytes", "split_items", "tail_split", "tile_offsets_fit"]

#: The kernel's launch parameters, which change its speed, never its result.
TUNABLES = ("block_n", "num_warps", "num_stages", "num_splits", "wave")

#: Hopper's shared memory per block (227 KiB), less room for the bias tiles (4 * block_n * stages B).
SMEM_BUDGET = 232448 - 2048

#: Most shares a last-wave item is cut into: each adds a partial to write and join, and past
#: four the last wave is short already.
MAX_TAIL_SPLIT = 4


def block_m(block_q: int) -> int:
    """Kernel tile rows: block_q rounded up to a power of two, at least 16 (tl.dot minimum)."""
    return max(16, 1 << (block_q - 1).bit_length())


def smem_bytes(D: int, block_m: int, block_n: int, num_stages: int, itemsize: int) -> int:
    """Shared memory of a launch: the query block plus a K and a V tile per stage."""
    return itemsize * D * (block_m + 2 * num_stages * block_n)


def default_launch(D: int, block_q: int, itemsize: int = 2) -> dict:
    """Launch defaults for Hopper, used where the caller passes None.

    ``block_n`` 64: three stages of K and V tiles plus the query block fit shared memory at D = 128,
    and a masked tail tile wastes at most 63 keys. ``num_warps`` 4 per 64 query rows (one warpgroup
    per wgmma M=64 slab). ``num_stages`` 3 (2 for D > 128, whose tiles are twice as large). Where
    that overflows shared memory (fp32 inputs, large tiles), stages, then ``block_n``, are cut.
    """
    rows = block_m(block_q)
    launch = {
        "block_n": 64,
        "num_warps": 8 if rows >= 128 else 4,
        "num_stages": 3 if D <= 128 else 2,
    }

    def fits():
        return smem_bytes(D, rows, launch["block_n"], launch["num_stages"], itemsize) <= SMEM_BUDGET

    while not fits() and launch["num_stages"] > 2:
        launch["num_stages"] -= 1
    while not fits() and launch["block_n"] > 16:
        launch["block_n"] //= 2
    return launch


def launch_config(D: int, block_q: int, itemsize: int, block_n: int | None, num_warps: int | None,
                  num_stages: int | None, num_splits: int | None, wave: int | None) -> dict:
    """:func:`default_launch` with the caller's overrides (None: the default), checked: ``block_n``
    a power of two >= 16 (tl.dot's minimum), ``num_splits`` an int in [1, 16] or None (only the last
    wave may split), ``wave`` an int >= 0 or None (read from the compiled kernel)."""
    launch = default_launch(D, block_q, itemsize)
    for name, value in (("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None:
            launch[name] = value
    bn = launch["block_n"]
    if not isinstance(bn, int) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot minimum), got {bn}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= 16):
        raise ValueError(f"num_splits must be an int in [1, 16] or None, got {num_splits!r}")
    if wave is not None and (isinstance(wave, bool) or not isinstance(wave, int) or wave < 0):
        raise ValueError(f"wave must be an int >= 0 or None, got {wave!r}")
    return launch


def tile_offsets_fit(t: Tensor, block_n: int) -> bool:
    """Whether ``block_n`` rows x D of ``t`` ([B, H, L, D]) are addressable with int32 offsets."""
    span = (block_n - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3)
    return span < 2**31 - 1


def tail_split(n_items: int, wave: int) -> tuple[int, int]:
    """``(n_whole, n_split)``: the first ``n_whole`` items run whole, the last wave's items in
    ``n_split`` programs each, as many as fit the wave (at most ``MAX_TAIL_SPLIT``). No split where
    the last wave is full or more than half full, or ``wave`` is 0 (unknown)."""
    tail = n_items % wave if wave > 0 else 0
    n_split = min(MAX_TAIL_SPLIT, wave // tail) if tail else 1
    return (n_items - tail, n_split) if n_split > 1 else (n_items, 1)


def split_items(n_items: int, num_splits: int | None, wave: int | None, measure) -> tuple[int, int]:
    """``(n_whole, n_split)`` of a launch of ``n_items`` items: ``num_splits`` > 1 splits every
    item that many ways and 1 none; None the last wave's (:func:`tail_split`), a wave being
    ``wave`` programs (None: ``measure()``, the GPU's wave for the kernel variant)."""
    if num_splits is not None:
        return (0, num_splits) if num_splits > 1 else (n_items, 1)
    return tail_split(n_items, measure() if wave is None else wave)


_WAVES: dict = {}


def device_wave(variant: tuple, warmup) -> int:
    """Programs of a kernel variant (``variant[0]``: its device; ``warmup()`` compiles it) the GPU
    holds at once: SMs x the fewest per SM its registers, shared memory and threads allow, read
    from the compiled kernel (loaded, not launched), cached per variant. 0 off CUDA or where the
    resources cannot be read."""
    device = variant[0]
    if device.type != "cuda":
        return 0
    if variant not in _WAVES:
        kernel = warmup()
        props = torch.cuda.get_device_properties(device)
        try:
            kernel._init_handles()  # loads the binary: n_regs is known from then on
            warps, regs, shared = kernel.metadata.num_warps, kernel.n_regs, kernel.metadata.shared
            by_regs = props.regs_per_multiprocessor // (-(-regs * 32 // 256) * 256 * warps)
            by_smem = props.shared_memory_per_multiprocessor // (shared + 1024)  # 1 KiB reserved per block
            by_threads = props.max_threads_per_multi_processor // (32 * warps)
            _WAVES[variant] = props.multi_processor_count * max(0, min(by_regs, by_smem, by_threads))
        except (AttributeError, TypeError):  # a Triton or torch without these fields: no split
            _WAVES[variant] = 0
    return _WAVES[variant]
