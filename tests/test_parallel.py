"""Head parallelism on the CPU (gloo): 2 and 4 processes run one rollout, each with 1/world of the
heads; the result equals one process's, TempCache merges the same tokens on every rank, and a rank
that dies ends the run with one clear error."""
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comfyui_fastar.fastar import AnnConfig, CacheConfig, FastARError, Rollout, TempCacheConfig
from comfyui_fastar.fastar.models import WanConfig, build_model
from comfyui_fastar.fastar.parallel import check_heads
from comfyui_fastar.fastar.rollout import OneProcess

# the tiny test model with 4 heads, so that 2 and 4 ranks divide them
CFG = WanConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, freq_dim=32)
# 64 x 128 pixels: 4 x 8 = 32 tokens a frame; 6 chunks of 1 frame over a budget of 3 frames (sink 1):
# TempCache merges (a low threshold, on random weights) from the third chunk on, and evicts from the fourth
SETTINGS = dict(frames=6, height=64, width=128, chunk_frames=1, seed=3,
                cache=TempCacheConfig(merge_threshold=0.4, max_cache_frames=3, sink_frames=1),
                ann=AnnConfig(keep_fraction=0.5, dense_steps_fraction=0.25))
GROUP_TIMEOUT_S = 20  # a collective waiting longer for a rank fails
RUN_TIMEOUT_S = 120   # the whole launch


def tiny_model():
    """Weights 5x the default's spread: attention then moves the latents by ~5e-3 (TempCache and AnnSA against
    dense attention), not ~3e-4, so that 1e-5 tells a sharded rollout that attends otherwise apart."""
    return build_model(CFG, seed=1).init_random(1, std=0.1)


def context():
    return torch.randn(1, 16, CFG.text_dim, generator=torch.Generator().manual_seed(5))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, fn, args, errors):
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels' torch twins: whole rollouts, not kernel tests
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException as exc:  # reported to the test, which names the rank
        errors.put((rank, type(exc).__name__, str(exc), traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(world, fn, out_dir, *args):
    """fn(rank, world, *args) on ``world`` spawned ranks of one gloo group; returns each rank's
    result, or each failing rank's (name, message) under key 'errors'. Never waits past RUN_TIMEOUT_S."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, str(out_dir), fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
    assert not hung, f"ranks {hung} still ran after {RUN_TIMEOUT_S} s"
    failed = {}
    while not errors.empty():
        rank, name, msg, tb = errors.get()
        failed[rank] = (name, msg, tb)
    results = {r: torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world) if r not in failed
               and procs[r].exitcode == 0}
    return results, failed, [p.exitcode for p in procs]


def cache_state(engine):
    """What a rank holds after the rollout, every per-head tensor in token order (through canon),
    so that AnnSA's per-head sorts never change what is compared."""
    c = engine.cache
    hist = c.history
    canon = c._canon                                                   # [L, B, H, M]
    def tok(x):                                                       # [L, B, rows, H, D] history -> token order
        rows = x[:, :, hist].permute(0, 1, 3, 2, 4)                    # [L, B, H, M, D]
        return rows.gather(3, canon[..., None].expand_as(rows))
    st = c.stats()
    sink = c.config.sink_frames * c.tokens_per_frame
    return dict(k=tok(c.k), v=tok(c.v), sink_k=c.k[:, :, :sink], sink_v=c.v[:, :, :sink],
                count=c._count.gather(-1, canon), newest=c._newest.gather(-1, canon),
                bias=c.log_count_bias[..., hist].gather(-1, canon), bytes=st.bytes, merged=st.merged,
                evicted=st.evicted, tokens_held=st.tokens_held, kv_bytes=c.k.nbytes + c.v.nbytes)


def sharded_rollout(rank, world):
    model = tiny_model()
    with torch.inference_mode():
        engine = Rollout(model, context(), group=dist.group.WORLD, **SETTINGS)
        chunks = []
        latents = engine.run(lambda r: chunks.append((r.cache.merged, r.cache.evicted)))
    return dict(latents=latents, heads=(engine.heads.held.start, engine.heads.held.stop), chunks=chunks,
                **cache_state(engine))


@pytest.fixture(scope="module")
def one_process():
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.delenv("TRITON_INTERPRET", raising=False)  # the twins, as the ranks run them
        model = tiny_model()
        with torch.inference_mode():
            engine = Rollout(model, context(), **SETTINGS)
            chunks = []
            latents = engine.run(lambda r: chunks.append((r.cache.merged, r.cache.evicted)))
        return dict(latents=latents, chunks=chunks, **cache_state(engine))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("world", [2, 4])
def test_head_parallel_rollout_equals_one_process(one_process, tmp_path, world):
    ref = one_process
    merged, evicted = map(sum, zip(*ref["chunks"]))
    assert merged > 0 and evicted > 0, ref["chunks"]  # the settings exercise TempCache's decisions
    results, failed, codes = launch(world, sharded_rollout, tmp_path)
    assert not failed, failed
    for rank, r in results.items():
        heads = slice(*r["heads"])
        assert heads == slice(rank * CFG.num_heads // world, (rank + 1) * CFG.num_heads // world)
        assert rel(r["latents"], ref["latents"]) <= 1e-5
        # the same tokens merged and kept, group sizes and frames, on every rank as in one process
        assert torch.equal(r["count"], ref["count"][:, :, heads])
        assert torch.equal(r["newest"], ref["newest"][:, :, heads])
        assert torch.equal(r["bias"], ref["bias"][:, :, heads])
        for name in ("k", "v", "sink_k", "sink_v"):
            part = ref[name][:, :, heads] if name in ("k", "v") else ref[name][..., heads, :]
            assert rel(r[name], part) <= 1e-5, name
        assert r["chunks"] == ref["chunks"] and r["tokens_held"] == ref["tokens_held"]
        # each rank holds 1/world of the cache
        assert r["kv_bytes"] * world == ref["kv_bytes"]
        assert r["bytes"] <= ref["bytes"] / world * 1.05
    for r in results.values():  # every rank decided alike: the token-ordered state of head 0 of each rank agrees
        assert torch.equal(r["count"][:, :, :1], results[0]["count"][:, :, :1])


def variants():
    """Settings beside SETTINGS': guidance (twice the batch) with a prompt switch (the history re-encoded
    through a fresh sharded cache), and the unbounded cache under AnnSA with chunks of 3 frames."""
    g = torch.Generator().manual_seed(9)
    neg, switch = torch.randn(context().shape, generator=g), torch.randn(context().shape, generator=g)
    return [dict(SETTINGS, frames=4, cfg=2.0, negative_context=neg, prompts=[(2, switch)]),
            dict(SETTINGS, frames=6, chunk_frames=3, cache=CacheConfig("unbounded"))]


def sharded_variants(rank, world, group=True):
    model = tiny_model()
    with torch.inference_mode():
        return [Rollout(model, context(), group=dist.group.WORLD if group else None, **v).run() for v in variants()]


def test_head_parallel_guidance_prompt_switch_and_unbounded_cache(tmp_path):
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.delenv("TRITON_INTERPRET", raising=False)
        ref = sharded_variants(0, 1, group=False)
    results, failed, _ = launch(2, sharded_variants, tmp_path)
    assert not failed, failed
    for outs in results.values():
        assert all(rel(a, b) <= 1e-5 for a, b in zip(outs, ref))


def dies_mid_rollout(rank, world):
    model = tiny_model()

    def on_chunk(report):
        if rank == 1 and report.chunk == 1:
            os._exit(3)  # no goodbye to the other ranks

    with torch.inference_mode():
        Rollout(model, context(), group=dist.group.WORLD, **SETTINGS).run(on_chunk)


def test_a_rank_that_dies_ends_the_run_with_one_clear_error(tmp_path):
    tic = time.monotonic()
    results, failed, codes = launch(2, dies_mid_rollout, tmp_path)
    assert codes[1] == 3 and 1 not in failed
    assert set(failed) == {0}, failed
    name, msg, _ = failed[0]
    assert name == "FastARError"
    assert msg.startswith("rank 0 of 2:") and "with the other ranks failed" in msg
    assert time.monotonic() - tic < GROUP_TIMEOUT_S + 60


def wrong_split(rank, world):
    model = build_model(WanConfig(dim=48, ffn_dim=96, num_heads=3, num_layers=1, text_dim=32, freq_dim=32), seed=1)
    Rollout(model, context(), group=dist.group.WORLD, **SETTINGS)


def test_heads_must_divide_among_the_ranks(tmp_path):
    assert check_heads(40, 4) == 10
    with pytest.raises(FastARError, match="40 attention heads among 3 ranks"):
        check_heads(40, 3)
    _, failed, _ = launch(2, wrong_split, tmp_path)
    assert sorted(failed) == [0, 1]
    assert all(f[0] == "FastARError" and "3 attention heads among 2 ranks" in f[1] for f in failed.values())


def test_cli_under_torchrun_env_runs_head_parallel_and_equals_one_process(tmp_path):
    """The CLI as torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set):
    two processes, rank 0 alone reports, and the latents equal one process's (on the CPU, gloo: two
    ranks need two GPUs)."""
    import subprocess
    import sys
    from safetensors.torch import load_file

    args = ["--frames", "4", "--chunk-frames", "1", "--height", "64", "--width", "64", "--max-cache-frames", "3",
            "--sink-frames", "1", "--annsa", "--keep-fraction", "0.5", "--dist-timeout", str(GROUP_TIMEOUT_S),
            "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"

    def cli(out, extra_env):
        return subprocess.Popen([sys.executable, "-m", "comfyui_fastar.fastar", "rollout", *args, "--plot", str(out) + ".png",
                                 "--json", str(out) + ".json", "--save-latents", str(out) + ".safetensors"],
                                env={**env, **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    port = str(free_port())
    ranks = [cli(tmp_path / f"rank{r}", dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                             MASTER_PORT=port)) for r in range(2)]
    one = cli(tmp_path / "one", {})
    outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in (*ranks, one)]
    assert [p.returncode for p in (*ranks, one)] == [0, 0, 0], [o[1][-2000:] for o in outs]
    assert "head-parallel over 2 ranks (1 of 2 heads per rank" in outs[0][0] and "chunk    4/4" in outs[0][0]
    assert outs[1][0] == "" and not (tmp_path / "rank1.json").exists()
    got, ref = (load_file(str(tmp_path / f"{n}.safetensors"))["latent"] for n in ("rank0", "one"))
    assert rel(got, ref) <= 1e-5


def test_more_ranks_than_gpus_is_one_clear_error(monkeypatch, capsys):
    """torchrun with more processes a node than GPUs: the rank without a GPU says so in one line, instead
    of NCCL timing out on two ranks sharing one."""
    from comfyui_fastar.fastar.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2").items():
        monkeypatch.setenv(key, value)
    assert main(["rollout", "--frames", "4", "--height", "64", "--width", "64"]) == 2
    assert capsys.readouterr().err.strip() == (
        "fastar: error: local rank 1 under torchrun needs GPU 1, and this machine shows 1: start at most that many "
        "processes a node (torchrun --nproc_per_node), or run them with --device cpu")


def test_one_rank_runs_the_one_process_path(tmp_path):
    """A group of one rank changes nothing: the one-process cache and attention, the same latents."""
    from comfyui_fastar.fastar import FastARAttention, TempCache

    settings = dict(SETTINGS, ann=None, frames=3)
    model = tiny_model()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        with torch.inference_mode():
            engine = Rollout(model, context(), group=dist.group.WORLD, **settings)
            assert type(engine.heads) is OneProcess and type(engine.cache) is TempCache
            assert type(engine.attention) is FastARAttention
            got = engine.run()
    finally:
        dist.destroy_process_group()
    with torch.inference_mode():
        assert torch.equal(got, Rollout(model, context(), **settings).run())
