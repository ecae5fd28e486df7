"""On a GPU: the quant plan's kernels equal their twins; an unbounded cache's growing plans compile
kernels only for larger tiles; the sink and the open chunk on cuDNN give what the kernel alone gives.
"""

import pytest
import torch

from comfyui_fastar.fastar import AnnConfig, CacheConfig, Rollout, TempCacheConfig
from comfyui_fastar.fastar import backend as backend_mod
from comfyui_fastar.fastar.models import build_model

pytestmark = pytest.mark.cuda


def test_quant_plan_kernels_equal_their_twins_on_the_gpu():
    """fp16 tensor-core dots of int8 levels, round-to-nearest divisions, no FMA: equal, not close."""
    from comfyui_fastar.kernels.quant_block_scores import quant_block_scores, quant_block_scores_torch
    from comfyui_fastar.kernels.quant_select import quant_select, quant_select_torch

    gen = torch.Generator(device="cuda").manual_seed(1)
    for lq, nkb, top in [(4680, 987, 346), (1000, 37, 5), (65, 1, 1)]:
        q = torch.randn(1, lq, 12, 128, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
        means = torch.randint(-127, 128, (1, 12, nkb, 128), device="cuda", generator=gen, dtype=torch.int8)
        scale = torch.rand(1, 12, device="cuda", generator=gen) * 1e-3
        bias = torch.randn(1, 12, nkb, device="cuda", generator=gen)
        bias[..., ::7] = float("-inf")
        score = quant_block_scores(q, means, scale, bias, 64)
        assert torch.equal(score, quant_block_scores_torch(q, means, scale, bias, 64))
        kw = dict(key_block=128, rows_start=0, rows_stop=nkb * 128 - 5, sink=0, chunk_start=nkb * 128,
                  chunk_stop=nkb * 128 + lq)
        held = bias > float("-inf")
        assert all(torch.equal(a, b) for a, b in zip(quant_select(score, held, top, **kw),
                                                      quant_select_torch(score, held, top, **kw)))


def test_quant_top_p_kernels_match_their_twins_on_the_gpu():
    """The share scores (exponentials round differently: close) and the top-p pick on the kernel's
    own shares (equal) at the chunk's shape."""
    from comfyui_fastar.kernels.quant_block_shares import quant_block_shares, quant_block_shares_torch
    from comfyui_fastar.kernels.quant_select import quant_select, quant_select_torch

    gen = torch.Generator(device="cuda").manual_seed(2)
    lq, nkb, nf = 4680, 220, 74
    q = torch.randn(1, lq, 12, 128, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
    int8 = lambda n: torch.randint(-127, 128, (1, 12, n, 128), device="cuda", generator=gen, dtype=torch.int8)
    scale = lambda: torch.rand(1, 12, device="cuda", generator=gen) * 1e-3
    bias = torch.randn(1, 12, nkb, device="cuda", generator=gen)
    bias[..., ::9] = float("-inf")
    counts = torch.randint(0, 129, (1, 12, nf), device="cuda", generator=gen).float()
    fixed = torch.randn(1, 12, nf, 128, device="cuda", generator=gen) * 0.02
    args = (q, int8(nkb), scale(), bias, fixed, counts, 64)
    share, fixed = quant_block_shares(*args)
    for got, want in zip((share, fixed), quant_block_shares_torch(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    kw = dict(key_block=128, rows_start=0, rows_stop=nkb * 128 - 5, sink=0, chunk_start=nkb * 128,
              chunk_stop=nkb * 128 + lq, mass=0.95, fixed=fixed)
    held = bias > float("-inf")
    assert all(torch.equal(a, b) for a, b in zip(quant_select(share, held, 22, **kw),
                                                  quant_select_torch(share, held, 22, **kw)))


@pytest.mark.parametrize("keep_mass", [0.95, 0.0], ids=["top-p", "fixed-share"])
def test_a_growing_cache_compiles_kernels_again_only_for_larger_tiles(keep_mass):
    """An unbounded cache's AnnSA plans grow every chunk. Triton specialises a kernel on its
    integer arguments' divisibility by 16 unless told not to, and each new combination is a
    compile: a stall of seconds in the middle of a rollout. After the first chunks, a kernel may
    compile again only for new compile-time constants (a tile that grew with the history)."""
    import triton

    from comfyui_fastar.fastar.models import build_model

    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip("this Triton has no post-compile hook (triton.knobs.runtime)")
    model = build_model("tiny", device="cuda", dtype=torch.bfloat16, seed=0)
    ctx = torch.randn(1, 5, model.context_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    compiled, repeats, chunk = {}, [], [0]

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        names, types = fn.jit_function.arg_names, compile["signature"]
        aligned = {names[path[0]] for path, attrs in compile["configs"][0].items()
                   if any(a[0] == "tt.divisibility" for a in attrs)}
        consts = (fn.name, repr.split("](")[0], str(sorted(compile["constants"].items())))
        if chunk[0] >= 3 and consts in compiled:  # same kernel, same constants: only a specialisation changed
            first, before, was = compiled[consts]
            repeats.append(f"chunk {chunk[0]}: {fn.name} again (first compiled at chunk {first}); divisible by 16 "
                           f"now but not before: {sorted(aligned - before)}, before but not now: {sorted(before - aligned)}"
                           f"; types changed: {sorted(n for n in types if types[n] != was.get(n))}")
        compiled.setdefault(consts, (chunk[0], aligned, types))

    def on_chunk(report):
        chunk[0] = report.chunk + 1

    # 256 tokens a frame: a 3-frame chunk adds six 128-key blocks, and plans grow by ~3 ranges a chunk
    rollout = Rollout(model, ctx, frames=3 * 40, height=256, width=256, chunk_frames=3, cache=CacheConfig(),
                      ann=AnnConfig(keep_mass=keep_mass))
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        rollout.run(on_chunk)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert rollout.cache.frames_held == 120  # the history was never bounded
    assert not repeats, "\n".join(repeats)


@pytest.mark.parametrize("cache_cfg, ann", [
    (TempCacheConfig(max_cache_frames=6, sink_frames=3), AnnConfig()),
    (CacheConfig(), AnnConfig(bits=4, probes=1, annca=True)),
], ids=["tempcache+quant", "unbounded+quant+annca"])
def test_fixed_rows_on_cudnn_equal_the_kernel_alone(cache_cfg, ann, monkeypatch):
    """A bf16 rollout with the sink and the open chunk attended by cuDNN (``attend_lse``, the
    kernel's prior) equals one with every key in the kernel; an fp32 model gets no prior (cuDNN
    computes fp32 wrongly when called directly), and its rollout stays finite."""
    ctx = torch.randn(2, 5, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    settings = dict(frames=15, height=64, width=96, chunk_frames=3, cache=cache_cfg, ann=ann)
    real, used = backend_mod.attend_lse, []  # AnnSA's priors and the biased dense calls'

    def counted(*args):
        out = real(*args)
        used.append(out is not None)
        return out

    for dtype in (torch.bfloat16, torch.float32):
        model = build_model("tiny", device="cuda", dtype=dtype, seed=0)
        used.clear()
        with monkeypatch.context() as m:
            m.setattr(backend_mod, "attend_lse", counted)
            with_prior = Rollout(model, ctx.to(dtype), **settings).run()
        assert used and all(used) == (dtype == torch.bfloat16) and any(used) == (dtype == torch.bfloat16)
        assert torch.isfinite(with_prior).all()
        with monkeypatch.context() as m:
            m.setattr(backend_mod, "attend_lse", lambda *a: None)
            alone = Rollout(model, ctx.to(dtype), **settings).run()
        err = ((with_prior.float() - alone.float()).norm() / alone.float().norm()).item()
        assert err <= (3e-2 if dtype == torch.bfloat16 else 0.0), err
