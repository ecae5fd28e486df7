"""The block-sparse kernel's launch configurations worth timing on Hopper, which the kernel's tests and
``bench/block_sparse_bench.py`` share; the kernel itself launches with ``kernels.launch.default_launch``."""

#: ``(block_q, block_n, num_warps, num_stages)`` at D = 128, each within sm_90's shared memory (a test
#: checks). ``block_q`` is part of a plan's meaning, so a planner picks it; the rest are tunables.
HOPPER_LAUNCH_GRID = (
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 32, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 32, 8, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
)
