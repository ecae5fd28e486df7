"""The benchmarks' shared parts (the package bench/common) and the scripts' CPU smoke runs (marked slow: each runs
a script end to end on the tiny model)."""
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
# Script checks run the torch twins: Triton's interpreter would only make them slow (the kernels have
# their own tests; the ann_bench smoke run keeps the interpreter to compare its kernels on real plans).
TWINS = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
sys.path.insert(0, BENCH)
import common  # noqa: E402
from common import fastar, testbed  # noqa: E402


def test_sensitize_ties_keys_to_queries_and_touches_nothing_else():
    plain = fastar.models.build_model("tiny", seed=3)
    model = common.sensitize(fastar.models.build_model("tiny", seed=3), qk_gain=1.5, k_noise=0.5, self_gain=5.0)
    changed = set()
    for (name, p0), (_, p1) in zip(plain.named_parameters(), model.named_parameters()):
        if not torch.equal(p0, p1):
            changed.add(name.split(".", 2)[-1])
    assert changed == {"self_attn.k.weight", "self_attn.o.weight", "self_attn.norm_q.weight",
                       "self_attn.norm_k.weight"}
    for b0, b1 in zip(plain.blocks, model.blocks):
        q, k = b1.self_attn.q.weight.flatten(), b1.self_attn.k.weight.flatten()
        corr = torch.corrcoef(torch.stack([q, k]))[0, 1].item()
        assert abs(corr - (1 + 0.5 ** 2) ** -0.5) < 0.05  # q + 0.5 * std(q) * noise
        torch.testing.assert_close(b1.self_attn.o.weight, 5.0 * b0.self_attn.o.weight)
        assert (b1.self_attn.norm_q.weight == 1.5).all() and (b1.self_attn.norm_k.weight == 1.5).all()


def _continue(model, ctx, prefix, attention=None):
    run = fastar.Rollout(model, ctx, frames=9, height=64, width=96, chunk_frames=3)
    if attention is not None:
        run.attention = attention(run.cache)
    with torch.inference_mode():
        return testbed.continue_real_video(run, 6, prefix)


def test_continuing_a_video_reads_the_prefix_only_through_the_cache():
    model = common.sensitize(fastar.models.build_model("tiny", seed=0))
    ctx = torch.randn(1, 5, model.context_dim, generator=torch.Generator().manual_seed(0))
    a = testbed.real_latents(6, 64, 96)
    b = a.flip(2)  # the same frames in another order
    out_a, out_b = _continue(model, ctx, a), _continue(model, ctx, b)
    assert out_a.shape == (1, 16, 3, 8, 12)
    assert not torch.equal(out_a, out_b)  # the cached history shapes what is generated
    # the control that drops the history generates the same thing whatever the prefix was
    own_a = _continue(model, ctx, a, testbed.OwnChunkOnly)
    own_b = _continue(model, ctx, b, testbed.OwnChunkOnly)
    assert torch.equal(own_a, own_b) and not torch.equal(own_a, out_a)


@pytest.mark.parametrize("cache,ann,other", [
    (fastar.TempCacheConfig(max_cache_frames=6), fastar.AnnConfig(), fastar.AnnConfig(dense_steps_fraction=0.0)),
    (fastar.CacheConfig("window", 3, 3), None, None),
], ids=["tempcache+annsa", "window"])
def test_a_forked_history_continues_as_the_run_it_copies(cache, ann, other, monkeypatch):
    """The frontier's shared history: a rollout's state copied into a fresh one (``fork``) generates what the
    source would, the source untouched; a twin that differs in the dense steps only generates what a run of
    its own over the same history does."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch twins: the state is what is tested
    model = common.sensitize(fastar.models.build_model("tiny", seed=0))
    ctx = torch.randn(1, 5, model.context_dim, generator=torch.Generator().manual_seed(0))
    latents = testbed.real_latents(12, 64, 96)

    def history(config, frames=12):
        run = fastar.Rollout(model, ctx, frames=18, height=64, width=96, chunk_frames=3, cache=cache, ann=config)
        with torch.inference_mode():
            testbed.RealVideoHistory(run, latents).to(frames)
        return run

    def gen(run):
        with torch.inference_mode():
            return testbed.generate(run, 2)
    straight, source = gen(history(ann)), history(ann)
    twin = testbed.fork(source, lambda: fastar.Rollout(model, ctx, frames=18, height=64, width=96, chunk_frames=3,
                                                       cache=cache, ann=other or ann))
    assert twin.cache.frames_cached == 12 and twin.cache is not source.cache
    forked = gen(twin)
    assert torch.equal(gen(source), straight)
    if other is None:
        assert torch.equal(forked, straight)
    else:
        assert torch.equal(forked, gen(history(other)))
    # and the steps the history took equal continue_real_video's, generation included
    run = fastar.Rollout(model, ctx, frames=18, height=64, width=96, chunk_frames=3, cache=cache, ann=ann)
    with torch.inference_mode():
        assert torch.equal(testbed.continue_real_video(run, 12, latents), straight)


def test_psnr_and_ssim():
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(1, 4, 2, 16, 16, generator=g)
    noise = 0.01 * torch.randn(ref.shape, generator=g)
    expected = 10 * torch.log10((ref.max() - ref.min()) ** 2 / noise.pow(2).mean()).item()
    assert abs(testbed.psnr(ref + noise, ref) - expected) < 1e-4
    assert abs(testbed.ssim(ref, ref) - 1.0) < 1e-6
    assert testbed.ssim(ref + noise, ref) > testbed.ssim(ref + 10 * noise, ref) > testbed.ssim(torch.rand_like(ref), ref)


@pytest.mark.slow
def test_e2e_runner_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "e2e_bench.py"), "--smoke", "--out", str(tmp_path)],
                          env=TWINS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "e2e_bench_smoke.json").read_text())
    # the defaults are TempCache alone: "fastar" stands for the TempCache-only row
    assert set(result["rollouts"]) == {"fastar", "annsa", "annca", "sink+window", "dense"}
    assert len(result["rollouts"]["fastar"]) == result["summary"]["chunks"]
    assert 0 < result["rollouts"]["annsa"][-1]["annsa_density"] <= 1  # logged where AnnSA runs, after the last chunk
    assert "annsa_density" not in result["rollouts"]["fastar"][-1]
    assert [p["source"] for p in result["dense_points"]][-1] == "composed"
    for row in result["fidelity"]:
        assert {"noise_floor", "own_chunk_only", "annsa", "annca", "fastar"} <= set(row) and "tempcache" not in row
        assert row["annsa"]["kv_held"] == 1.0 and row["fastar"]["kv_held"] <= 1.0  # unbounded holds it all
        assert 0 < row["annsa"]["annsa_recall"] <= 1 + 1e-6 and 0 < row["annsa"]["annsa_density"] <= 1
        assert "annsa_recall" not in row["fastar"] and "annsa_recall" not in row["annca"]
    assert result["summary"]["speedup_auc"] > 0
    assert (tmp_path / "e2e_bench_smoke.png").stat().st_size > 0


@pytest.mark.slow
def test_ann_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "ann_bench.py"), "--smoke", "--out", str(tmp_path),
                           "--quant-keep", "0.35,1.0", "--annca-bits", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "ann_bench_smoke.json").read_text())
    rows = {r["keep_fraction"]: r for r in result["settings"]}
    assert set(rows) == {0.35, 1.0}
    every = rows[1.0]
    assert every["density"] == 1.0 and every["recall"] > 0.999  # every key block kept: dense
    assert every["ranges_per_block"] == 3  # sink, chunk, and all history blocks fused into one range
    assert rows[0.35]["density"] < 1
    assert all(layer["scores_equal_twin"] and layer["select_equals_twin"] for r in result["settings"]
               for layer in r["per_layer"])
    assert all(r["recall"] >= r["history_recall"] - 1e-6 for r in result["settings"])  # own chunk is always read
    (ca,) = result["annca"]
    assert 0 < ca["density"] <= 1 and 0 < ca["recall"] <= 1
    assert (tmp_path / "ann_bench_smoke.png").stat().st_size > 0


def test_real_prompt_context():
    from safetensors import safe_open

    import make_prompt_fixture

    path = os.path.join(BENCH, "data", "wan_prompt_minilm.safetensors")
    with safe_open(path, "pt") as f:
        assert f.metadata()["text"] == make_prompt_fixture.clip_prompt()  # the clip's own prompt
        n = f.get_slice("positive").get_shape()[0]
    for text_dim in (4096, 32):  # Wan's width, and the tiny model's (a projection, not a lift)
        ctx = testbed.prompt_context(text_dim)
        assert ctx.shape == (1, 512, text_dim)
        real = ctx[0, :n]
        assert (real.abs().sum(-1) > 0).all() and (ctx[0, n:] == 0).all()  # zero-padded as Wan pads umT5
        assert abs(real.mean().item()) < 1e-4 and abs(real.std().item() - 1) < 1e-3
        torch.testing.assert_close(testbed.prompt_context(text_dim), ctx)  # a fixed map


def test_dense_curve_interpolates_between_points_and_clamps_outside():
    import e2e_bench

    at = e2e_bench.dense_curve([{"frames": 30, "latency_ms": 300.0}, {"frames": 10, "latency_ms": 100.0},
                                {"frames": 20, "latency_ms": 150.0}])
    assert [at(f) for f in (5, 10, 15, 20, 25, 30, 40)] == [100.0, 100.0, 125.0, 150.0, 225.0, 300.0, 300.0]


@pytest.mark.slow
def test_ann_bound_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "ann_bound.py"), "--smoke", "--out", str(tmp_path)],
                          env=TWINS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "ann_bound_smoke.json").read_text())["rows"]
    assert [(r["cached_frames"], r["target_density"]) for r in rows] == [
        (f, d) for f in (6, 12) for d in (0.5, 0.25, 0.125)]
    for r in rows:  # a density below the own chunk's share (3 of frames + 3) is not reachable
        assert r["reachable"] == (r["target_density"] > 3 / (r["cached_frames"] + 3))
        if r["reachable"]:
            assert r["density"] >= r["target_density"] - 1e-6
            assert r["within_bound"] == (r["call_over_dense"] <= r["bound_over_dense"])
            assert r["within_bound_eager"] == (r["plan_ms"] + r["sparse_ms"] <= r["bound_eager_ms"])


@pytest.mark.slow
def test_frontier_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "frontier.py"), "--smoke", "--out", str(tmp_path)],
                          env=TWINS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "frontier_smoke.json").read_text())
    assert result["complete"] and result["horizons"] == [9, 15]
    rows = {r["name"]: r for r in result["settings"]}
    fastar_names = [f"fastar{b}-p{m}{d}" for m in (".95", ".9") for d in ("", "-nodense") for b in (6, 12)]
    assert set(rows) == {"window3", "window6", "tempcache6", "tempcache12", *fastar_names}
    for r in rows.values():
        assert r["precision"] == "bf16" and r["ms"] > 0 and 0 < r["density"] <= 1
        assert r["chunks"] == -(-r["held_frames"] // 3) + 5 == len(r["all_ms"])  # full for its last 5 chunks
        assert set(r["fidelity"]) == {"9", "15"} and all(f["psnr"] > 0 for f in r["fidelity"].values())
        # a recall is measured on the calls AnnSA runs sparse: none where it stands aside (the smoke's
        # budgets of 6 and 12 frames are below the 15 its history needs to pay; its density is then 1)
        assert ("annsa_recall" in r["fidelity"]["15"]) == (r["family"] == "fastar" and r["density"] < 1)
    assert rows["window6"]["chunks"] == 8 and rows["tempcache12"]["chunks"] == 9
    assert rows["fastar12-p.9-nodense"]["ann"]["dense_steps_fraction"] == 0.0
    assert rows["tempcache6"]["fidelity"]["15"]["kv_held"] < rows["tempcache12"]["fidelity"]["15"]["kv_held"]
    refs = result["references"]
    assert refs["9"]["noise_floor"]["psnr"] > 0 and refs["15"]["noise_floor"] is None  # fp32 at the first only
    assert "noise_floor_note" in refs["15"] and refs["15"]["own_chunk_only"]["psnr"] > 0
    for h, front in result["pareto"].items():  # nothing on the front is beaten on both axes
        pts = [(rows[n]["ms"], rows[n]["fidelity"][h]["psnr"]) for n in front]
        assert front and all(not (m2 <= m and p2 >= p and (m2, p2) != (m, p)) for m, p in pts
                             for m2, p2 in ((r["ms"], r["fidelity"][h]["psnr"]) for r in rows.values()))
    beaten = result["windows_beaten"]
    assert beaten["horizon"] == 15 and set(beaten["by"]) == {"window3", "window6"}
    for w, by in beaten["by"].items():
        if by is not None:
            assert rows[by]["ms"] <= rows[w]["ms"] and rows[by]["fidelity"]["15"]["psnr"] > rows[w]["fidelity"]["15"]["psnr"]
    assert (tmp_path / "frontier_smoke.png").stat().st_size > 0


@pytest.mark.slow
def test_head_budgets_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "head_budgets.py"), "--smoke", "--shares", "0.5,1",
                           "--repeats", "1", "--out", str(tmp_path)], env=TWINS, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "head_budgets_smoke.json").read_text())
    rows = result["settings"]
    split = [f"tempcache{b}-s{s}" for b in (6, 9) for s in ("0.5", "1", "1-most")]
    assert set(rows) == {"window12", "tempcache6", "tempcache9", *split}
    assert all(r["ms"] > 0 for n, r in rows.items() if not n.endswith("-most"))
    assert all(rows[n]["ms"] is None for n in rows if n.endswith("-most"))  # the control is not timed
    mass = torch.tensor(result["history_mass"])
    assert mass.shape == (2, 2) and ((mass > 0) & (mass < 1)).all()
    # half the heads static: per layer the one with the least history mass (the control: the most)
    assert result["static_heads"]["tempcache6-s0.5"] == [[int(row.argmin())] for row in mass]
    for b in (6, 9):
        every = rows[f"tempcache{b}-s1"]
        assert every["psnr_15"] == rows[f"tempcache{b}-s1-most"]["psnr_15"]  # all heads static either way
        # static heads still read the sink, which the own-chunk control drops; and they lose the history
        assert result["own_chunk_only"]["15"] < every["psnr_15"] < rows[f"tempcache{b}"]["psnr_15"]


@pytest.mark.slow
def test_ab_smoke(tmp_path):
    """A and B the same tree: two packages, one model's weights, so the latents must agree exactly."""
    root = os.path.dirname(BENCH)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "ab.py"), root, "--smoke", "--out", str(tmp_path)],
                          env=TWINS, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "ab_smoke.json").read_text())
    assert list(result["settings"]) == ["fastar", "window"]
    for row in result["settings"].values():
        assert len(row["a_chunk_ms"]) == len(row["b_chunk_ms"]) == result["repeats"] == 2
        assert all(len(t) == result["chunks"] for t in row["a_chunk_ms"] + row["b_chunk_ms"])
        for ms, chunks in zip(row["a_ms_per_round"], row["a_chunk_ms"]):  # a round: the median of its last chunks
            assert abs(ms - statistics.median(chunks[-result["steady"]:])) <= 0.05 + 1e-9  # (stored to 0.1 ms)
        assert row["b_over_a"] == statistics.median(b / a for a, b in zip(row["a_ms_per_round"], row["b_ms_per_round"]))
        assert row["b_vs_a_latents_rel"] == 0.0
    assert "TempCacheConfig" in result["settings"]["fastar"]["a"] and "window" in result["settings"]["window"]["b"]
    assert "B/A" in proc.stdout


def test_ab_exports_a_revision_without_the_bench(tmp_path, monkeypatch):
    import ab

    try:
        head = ab.git("rev-parse", "HEAD")
    except Exception:  # not a git checkout (an unpacked archive)
        pytest.skip("no git history here")
    monkeypatch.setattr(ab, "EXPORTS", str(tmp_path))
    folder, commit = ab.export("HEAD")
    assert commit == head and folder == str(tmp_path / head)
    assert os.path.isfile(os.path.join(folder, "fastar", "__init__.py")) and os.path.isfile(os.path.join(folder, "__init__.py"))
    assert not os.path.exists(os.path.join(folder, "bench")) and not os.path.exists(os.path.join(folder, "tests"))
    assert ab.resolve(folder) == (folder, head)  # the exported folder names its commit
    assert ab.export("HEAD") == (folder, commit)  # exported once
    with pytest.raises(SystemExit, match="neither a folder nor a git revision"):
        ab.resolve("no-such-revision")


@pytest.mark.slow
def test_chunk_profile_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "chunk_profile.py"), "--smoke", "--out", str(tmp_path),
                           "--settings", "fastar,sink+window"], env=TWINS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "chunk_profile_smoke.json").read_text())
    assert set(result) == {*common.HEADER, "chunk", "prompt", "fastar", "sink+window"}
    assert all(result[name]["wall_ms"] > 0 for name in ("fastar", "sink+window"))
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "chunk_profile.py"), "--smoke", "--settings", "lsh"],
                         env=TWINS, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown settings lsh" in bad.stderr


def test_reproduce_makes_every_figure_in_results_and_the_readme():
    import re

    import reproduce

    names = {f.name for f in reproduce.FIGURES}
    results = os.path.join(BENCH, "results")
    pngs = {f[:-4] for f in os.listdir(results) if f.endswith(".png")}
    archived = {f[:-4] for f in os.listdir(os.path.join(results, "archive")) if f.endswith(".png")}
    assert pngs <= names and names - pngs <= archived  # (a run older than its script's output waits in archive/)
    with open(os.path.join(os.path.dirname(BENCH), "README.md")) as f:
        shown = re.findall(r"!\[[^\]]*\]\(bench/results/([^)/]+)\.png\)", f.read())
    assert set(shown) <= pngs
    for fig in reproduce.FIGURES:  # the script named writes that figure: by its own name, or as the --tag given
        with open(os.path.join(BENCH, fig.args[0])) as f:
            assert fig.name in f.read() or fig.args[fig.args.index("--tag") + 1] == fig.name


def test_reproduce_lists_and_skips_what_this_machine_cannot_run(tmp_path, capsys):
    import reproduce

    assert reproduce.main(["--list", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[0] for x in lines[:-1:2]] == [f"{n}.png" for n in ("core_bench", "tempcache_bench", "ann_bench",
                                                                           "ann_bench_random", "e2e_bench", "frontier",
                                                                           "frontier_wan", "comfy_bench",
                                                                           "comfy_defaults_wan", "comfy_defaults_random",
                                                                           "stream_memory",
                                                                           "sampler_stream_memory",
                                                                           "sampler_stream_memory_gpu",
                                                                           "world_train_loss", "world_eval")]
    assert f"ann_bench.py --prompt random --tag ann_bench_random --out {tmp_path}" in lines[7]
    assert lines[-1] == f"in all ~{sum(f.minutes for f in reproduce.FIGURES):g} minutes"
    assert reproduce.main(["--only", "stream_memory", "--out", str(tmp_path)]) == 1  # not written: exit status 1
    assert "stream_memory: skipped, needs --comfyui" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_every_result_file_names_its_commit_command_and_device():
    """Each committed result (outside archive/) says what wrote it: the commit (one of this repository's, where
    it has its history; "unknown" off git) and the command, and the device; one written before results
    recorded these carries them reconstructed (dirty unknown), with a note saying so."""
    results = os.path.join(BENCH, "results")
    names = sorted(f for f in os.listdir(results) if f.endswith(".json"))
    assert names
    git = subprocess.run(["git", "-C", common.ROOT, "rev-parse", "HEAD"], capture_output=True).returncode == 0
    for name in names:
        with open(os.path.join(results, name)) as f:
            result = json.load(f)
        assert {"commit", "dirty", "command", "device"} <= set(result), name
        assert result["command"].startswith("python bench/"), name
        if result["commit"] == "unknown":  # written off git (a copied tree): nothing more to check
            assert result["dirty"] is None, name
            continue
        if result["dirty"] is None:  # a commit but no dirty flag: not recorded when written
            assert result["provenance"].startswith("reconstructed: "), name
        if git:
            found = subprocess.run(["git", "-C", common.ROOT, "cat-file", "-e", result["commit"] + "^{commit}"])
            assert found.returncode == 0, (name, result["commit"])


def test_header_records_the_commit_the_command_and_write_json_insists(tmp_path):
    import subprocess as sp

    argv = [os.path.join(BENCH, "e2e_bench.py"), "--smoke", "--out", str(tmp_path / "a b")]
    result = common.header("cpu", argv)
    assert result["command"] == f"python bench/e2e_bench.py --smoke --out '{tmp_path / 'a b'}'"
    assert result["device"].startswith("CPU")
    try:
        head = sp.run(["git", "-C", common.ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                      check=True).stdout.strip()
    except (OSError, sp.CalledProcessError):  # a copied tree
        assert (result["commit"], result["dirty"]) == ("unknown", None)
    else:
        assert result["commit"] == head and isinstance(result["dirty"], bool)
    path = common.write_json(str(tmp_path), "x.json", {**result, "rows": [1]})
    with open(path) as f:
        assert json.load(f) == {**result, "rows": [1]}
    with pytest.raises(ValueError, match="lacks commit, dirty, command"):
        common.write_json(str(tmp_path), "y.json", {k: result[k] for k in ("device", "date", "torch")})
    assert not (tmp_path / "y.json").exists()


def _imports(path: str) -> set:
    """The top-level modules a file imports by absolute name."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_bench_script_imports_another_script_and_no_test_another_test():
    """What the scripts share lives in bench/common; a script imports from there, never from another script,
    and nothing in bench/ imports from tests/; no test imports another test module (shared helpers: conftest's
    fixtures and comfyui_fastar.testing)."""
    here = os.path.dirname(os.path.abspath(__file__))
    scripts = {f[:-3]: os.path.join(BENCH, f) for f in os.listdir(BENCH) if f.endswith(".py")}
    shared = {f[:-3]: os.path.join(BENCH, "common", f) for f in os.listdir(os.path.join(BENCH, "common"))
              if f.endswith(".py")}
    tests = {f[:-3]: os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py")}
    assert {"e2e_bench", "frontier", "comfy_bench"} <= set(scripts) and "rollouts" in shared
    for name, path in {**scripts, **{"common." + n: p for n, p in shared.items()}}.items():
        imported = _imports(path)
        assert not imported & (set(scripts) - {name}), (path, imported & set(scripts))
        assert not imported & set(tests), (path, imported & set(tests))
    for name, path in tests.items():
        assert not _imports(path) & (set(tests) - {name}), (path, _imports(path) & set(tests))


@pytest.mark.slow
def test_cpu_figures_smoke(tmp_path):
    """bench/cpu_figures.py --smoke: ``fastar`` under two thread settings, quiet and beside a busy process, each
    run's seconds, world chunk and load recorded, and the medians with World Play's frames a second."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "cpu_figures.py"), "--smoke", "--settings", "omp1,set1",
                           "--out", str(tmp_path)], env=TWINS, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "cpu_figures_smoke.json").read_text())
    assert result["device"].startswith("CPU") and result["command"].startswith("python bench/cpu_figures.py --smoke")
    assert set(result["fastar"]) == {"quiet", "busy"} and result["template"] == {}
    for by_setting in result["fastar"].values():
        assert set(by_setting) == {"omp1", "set1"}
        for s in by_setting.values():
            (run,) = s["runs"]
            assert s["median_s"] == run["seconds"] > 0 and s["chunk_ms"] == run["chunk_ms"] > 0
            assert s["world_play_fps"] == round(12 / (run["chunk_ms"] / 1e3), 1) and len(run["loadavg"]) == 3


@pytest.mark.slow
def test_matrix_game_bench_smoke_profiles_a_chunk_by_part(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "matrix_game_bench.py"), "--smoke", "--profile",
                           "--settings", "window6,tempcache6", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=TWINS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    settings = json.loads((tmp_path / "matrix_game_bench_smoke.json").read_text())["settings"]
    assert set(settings) == {"window6", "tempcache6"} and settings["window6"]["vs_window6"] == 1.0
    assert all(set(s["profile"]) == {"kernel_ms", "by_part_ms", "top_kernels_ms", "kernels"} for s in settings.values())
    sys.path.insert(0, BENCH)
    import matrix_game_bench

    names = {"triton_poi_fused_add_0": "other", "_pair_cosine_kernel": "tempcache merge",
             "_attend_tile": "attention", "cudnn_generated_fort_native_sdpa_sm90": "attention",
             "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "_qk_norm_rope_kernel": "norm and rope",
             "_merge_rows_kernel": "tempcache merge", "_quant_scores_kernel": "annsa planning"}
    assert {name: matrix_game_bench.part(name) for name in names} == names
