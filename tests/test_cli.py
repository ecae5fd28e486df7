"""The main job runs on the CPU default path and rejects bad arguments with one line."""
import json
import os

import pytest
import torch

from comfyui_fastar.fastar import photo_world
from comfyui_fastar.fastar.cli import main


def _wan_video(latent):
    """Wan's causal VAE: the first latent frame decodes to 1 video frame, every later one to 4."""
    return 1 + 4 * (latent - 1)


def test_video_and_latent_frames_follow_wans_vae():
    from comfyui_fastar.fastar import latent_frames, video_frames

    assert [video_frames(n) for n in range(1, 8)] == [_wan_video(n) for n in range(1, 8)]
    assert all(latent_frames(video_frames(n)) == n for n in range(0, 300))
    assert video_frames(0) == 0 and latent_frames(0) == 0


def test_cli_runs_and_writes_plot_and_table(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    figures = []  # the plot as written: its axes' labels and lines
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **kw: (figures.append(fig), save(fig, *a, **kw))[1])
    plot, table = tmp_path / "run.png", tmp_path / "run.json"
    rc = main(["rollout", "--frames", "6", "--chunk-frames", "3", "--height", "64", "--width", "64",
               "--cache", "window", "--sink-frames", "1", "--window-frames", "2",
               "--plot", str(plot), "--json", str(table)])
    assert rc == 0
    out = capsys.readouterr().out
    # the per-chunk lines count video frames (what a sampler's length counts), latent frames beside them
    assert f"chunk    1/2 | frames {_wan_video(3):5d}/{_wan_video(6)} video (3/6 latent) |" in out
    assert f"chunk    2/2 | frames {_wan_video(6):5d}/{_wan_video(6)} video (6/6 latent) |" in out
    assert f"{_wan_video(6)} video frames (6 latent)" in out and "plot written" in out
    assert out.splitlines()[-1].startswith(f"fastar: 2 chunks, {_wan_video(6)} video frames; ")  # the summary last
    assert "ms a chunk (median of the last 1); the cache holds" in out and "\r" not in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads(table.read_text())
    rows = written["chunks"]
    assert [r["frames"] for r in rows] == [3, 6] and written["frames"] == 6
    assert [r["video_frames"] for r in rows] == [_wan_video(3), _wan_video(6)]
    assert written["video_frames"] == _wan_video(6)
    assert rows[1]["cache_tokens"] == 3 * 16  # sink 1 + window 2 frames of 4x4 tokens
    (fig,) = figures
    for ax in fig.axes:  # both panels: x in video frames, each line's points at the chunks' video frames
        assert ax.get_xlabel().startswith("video frames")
        assert ax.get_lines() and all(list(line.get_xdata()) == [_wan_video(3), _wan_video(6)]
                                      for line in ax.get_lines())


@pytest.mark.parametrize("argv,message", [
    (["--frames", "7"], "--frames 7 is not divisible by --chunk-frames 3"),
    (["--frames", "3", "--height", "50"], "height=50 must be a positive multiple of 16"),
    (["--checkpoint", "nope.safetensors"], "checkpoint not found: nope.safetensors"),
    (["--frames", "3", "--timesteps", "250,500"], "strictly decreasing"),
    (["--frames", "3", "--cache", "window", "--window-frames", "0"], "window_frames must be"),
    (["--frames", "3", "--merge-threshold", "1.5"], "TempCacheConfig.merge_threshold must lie in (0, 1]"),
    (["--frames", "3", "--max-cache-frames", "4"], "TempCacheConfig.max_cache_frames 4 leaves 1 frame of history beside 3 frames of sink"),
    (["--frames", "3", "--recall-frames", "-1"], "TempCacheConfig.recall_frames must be an integer >= 0"),
    (["--frames", "3", "--recall-frames", "2", "--annsa"], "recalled frames that AnnSA's plans do not read"),
])
def test_cli_bad_arguments_one_line(argv, message, capsys, tmp_path):
    assert main(["rollout", *argv, "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fastar: error: ") and message in err[-1]
    assert not any("Traceback" in line for line in err)


def test_cli_default_tempcache_stays_within_budget(tmp_path, capsys):
    table = tmp_path / "t.json"
    assert main(["rollout", "--frames", "18", "--height", "64", "--width", "64", "--max-cache-frames", "7",
                 "--plot", str(tmp_path / "t.png"), "--json", str(table)]) == 0
    rows = json.loads(table.read_text())["chunks"]
    assert json.loads(table.read_text())["cache"] == "tempcache"
    assert max(r["cache_tokens"] for r in rows) <= 7 * 16 < rows[-1]["frames"] * 16
    assert "budget 7 frames" in capsys.readouterr().out


def test_cli_recall_frames_reach_the_cache(tmp_path, capsys):
    """The memory tier holds the budget and its recalled frames on the device, the rest on the host."""
    table = tmp_path / "t.json"
    assert main(["rollout", "--frames", "18", "--height", "64", "--width", "64", "--max-cache-frames", "7",
                 "--recall-frames", "2", "--plot", str(tmp_path / "t.png"), "--json", str(table)]) == 0
    rows = json.loads(table.read_text())["chunks"]
    assert max(r["cache_tokens"] for r in rows) <= 9 * 16 and rows[-1]["cache_tokens"] > 7 * 16
    assert "recall 2 frames" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cli_cuda_without_a_gpu_is_one_line(capsys, tmp_path):
    assert main(["rollout", "--device", "cuda", "--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.strip() == "fastar: error: --device cuda: no CUDA device is available"


def test_cli_unknown_cache_mode_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["rollout", "--cache", "ring"])
    assert exc.value.code == 2
    assert "invalid choice: 'ring'" in capsys.readouterr().err


def test_cli_ann_runs_and_refuses_the_window_cache(tmp_path, capsys):
    args = ["rollout", "--frames", "6", "--height", "64", "--width", "64", "--plot", str(tmp_path / "a.png")]
    assert main(args + ["--annsa", "--cache", "unbounded"]) == 0
    assert "AnnSA sparse attention" in capsys.readouterr().out
    assert main(args + ["--annsa", "--cache", "window"]) == 2
    assert "window cache" in capsys.readouterr().err


def _engine_kwargs(monkeypatch, key):
    """The ``key`` keyword of every Rollout the CLI builds, in order."""
    from comfyui_fastar.fastar import cli

    seen = []

    class Spy(cli.Rollout):
        def __init__(self, *a, **kw):
            seen.append(kw[key])
            super().__init__(*a, **kw)

    monkeypatch.setattr(cli, "Rollout", Spy)
    return seen


def test_cli_default_is_tempcache_alone_and_ann_quant_runs_annsa(tmp_path, capsys, monkeypatch):
    """No --annsa: TempCache at its default budget without AnnSA (the defaults); --annsa adds AnnSA,
    whose density and share of sparse layers the table and the lines report."""
    from comfyui_fastar.fastar import AnnConfig, TempCacheConfig

    seen = _engine_kwargs(monkeypatch, "ann")
    caches = _engine_kwargs(monkeypatch, "cache")
    args = ["rollout", "--frames", "6", "--height", "64", "--width", "64", "--plot", str(tmp_path / "a.png")]
    table = tmp_path / "t.json"
    assert main(args + ["--json", str(table)]) == 0
    assert seen[-1] is None and caches[-1] == TempCacheConfig() and json.loads(table.read_text())["annsa"] is False
    out = capsys.readouterr().out
    assert "AnnSA reads" not in out and "of layers" not in out
    assert main(args + ["--annsa", "--json", str(table)]) == 0
    assert seen[-1] == AnnConfig() and json.loads(table.read_text())["annsa"] is True
    rows = json.loads(table.read_text())["chunks"]
    assert all(0 < r["annsa_density"] <= 1 for r in rows) and rows[-1]["annsa_density"] < 1  # sparse at the end
    assert all(0 <= r["annsa_sparse"] <= 1 for r in rows)  # the share of AnnSA's layers that ran sparse
    out = capsys.readouterr().out
    assert "AnnSA sparse attention" in out and "AnnSA reads" in out
    lines = [line for line in out.splitlines() if line.startswith("chunk ")]
    assert len(lines) == len(rows) and all(f"sparse in {r['annsa_sparse']:4.0%} of layers" in line
                                           for line, r in zip(lines, rows))
    assert main(args + ["--annsa", "--keep-mass", "0.9"]) == 0 and seen[-1].keep_mass == 0.9


def test_cli_keep_flags_reach_the_plan_and_are_checked(tmp_path, capsys, monkeypatch):
    seen = _engine_kwargs(monkeypatch, "ann")
    args = ["rollout", "--frames", "6", "--height", "64", "--width", "64", "--plot", str(tmp_path / "a.png"),
            "--cache", "unbounded"]
    assert main(args + ["--annsa", "--keep-mass", "0", "--keep-fraction", "0.35"]) == 0
    assert (seen[-1].keep_mass, seen[-1].keep_fraction) == (0.0, 0.35)
    assert main(args + ["--annsa", "--keep-mass", "1.5"]) == 2
    assert "keep_mass must lie in [0, 1]" in capsys.readouterr().err
    assert main(args + ["--keep-fraction", "0.5"]) == 2  # no AnnSA to set
    assert "--keep-fraction sets AnnSA's plan: add --annsa" in capsys.readouterr().err
    assert len(seen) == 1


def test_cli_eager_reaches_the_engine(tmp_path, capsys, monkeypatch):
    """--eager turns off CUDA graph replay (on a CPU the engine runs eagerly either way)."""
    seen = _engine_kwargs(monkeypatch, "cuda_graphs")
    args = ["rollout", "--frames", "3", "--height", "64", "--width", "64", "--plot", str(tmp_path / "a.png")]
    assert main(args) == 0
    graphed = capsys.readouterr().out
    assert main(args + ["--eager"]) == 0
    assert seen == [True, False]
    assert ("CUDA graph" in graphed) == torch.cuda.is_available()  # replayed only where there is CUDA
    assert "CUDA graph" not in capsys.readouterr().out


def test_cli_fp8_linears_reach_the_model_and_need_a_16_bit_dtype(tmp_path, capsys, monkeypatch):
    from comfyui_fastar.fastar import cli
    from comfyui_fastar.fastar.models import Fp8Linear

    seen = []

    class Spy(cli.Rollout):
        def __init__(self, model, *a, **kw):
            seen.append(model)
            super().__init__(model, *a, **kw)

    monkeypatch.setattr(cli, "Rollout", Spy)
    args = ["rollout", "--frames", "3", "--height", "64", "--width", "64", "--plot", str(tmp_path / "a.png"), "--model", "tiny"]
    assert main(args + ["--fp8-linears", "--dtype", "bfloat16"]) == 0
    assert "fp8 linears" in capsys.readouterr().out
    assert isinstance(seen[-1].blocks[0].ffn[0], Fp8Linear) and isinstance(seen[-1].blocks[0].self_attn.q, Fp8Linear)
    assert main(args + ["--dtype", "bfloat16"]) == 0
    assert not isinstance(seen[-1].blocks[0].ffn[0], Fp8Linear)
    assert main(args + ["--fp8-linears", "--dtype", "float32"]) == 2
    assert "--fp8-linears needs --dtype bfloat16 or float16" in capsys.readouterr().err
    assert len(seen) == 2


def test_the_default_flies_the_world_and_writes_what_each_cache_remembers(tmp_path, capsys):
    """``fastar`` with no arguments: the trained world over a held-out photograph with the window and with
    TempCache, the side-by-side GIF (ground truth | window | TempCache), the latency plot and the summary."""
    from PIL import Image

    assert main(["--revisit", "36", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "36 shown, 36 generated in 3 chunks, back over a place after 36 frames" in out
    assert "trained on" not in out  # a held-out photograph: what the model was made to show
    summary = json.loads((tmp_path / "world.json").read_text())
    assert set(summary["caches"]) == {"window (sink 3 + 12)", "TempCache 12"}
    for name, s in summary["caches"].items():
        assert s["psnr_revisit"] > 15 and s["tokens_held"] <= 15 * 256 and len(summary["chunks"][name]) == 3
        assert f"the revisit {s['psnr_revisit']:.1f} dB" in out
    with Image.open(tmp_path / "world.gif") as gif:
        assert gif.n_frames == 72 and gif.size[0] > 3 * 128
    assert (tmp_path / "world_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_world_flies_action_text_over_any_photograph(tmp_path, capsys):
    from PIL import Image

    photo = tmp_path / "mine.png"
    Image.fromarray((torch.rand(200, 240, 3) * 255).byte().numpy()).save(photo)
    assert main(["--world", str(photo), "--actions", "D, W+A*6f, zoom_in*6f", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "world.json").read_text())
    assert summary["video_frames"] == 12 + 24 and summary["revisit"] is None  # 12 observed, padded to whole chunks
    out = capsys.readouterr().out
    assert "the revisit" not in out
    # one's own photograph: said once, before the run, what the model was trained on and what to expect
    (said,) = [line for line in out.splitlines() if "trained on" in line]
    assert said == ("fastar: the pack's world model (7.5 M parameters) was trained on 12 photographs: over one of "
                    "your own it drifts to texture within a few chunks (the held-out ones in "
                    f"{os.path.join(photo_world.PHOTOS, 'heldout')} show what it remembers)")
    assert out.index(said) < out.index("flies")


def test_an_unwritable_out_is_refused_before_the_run(tmp_path, capsys):
    """``--out`` where nothing can be written: one line naming the option and the folder, at once."""
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "world"
    assert main(["--out", str(out)]) == 2
    said = capsys.readouterr()
    assert said.err.strip() == f"fastar: error: --out {out}: cannot write there (Not a directory)"
    assert said.out == ""  # nothing ran


@pytest.mark.parametrize("argv,message", [
    (["--frames", "6"], "--frames belongs to Wan 2.1 rollouts: fastar rollout --frames 6"),
    (["--actions", "W*2, jump"], "--actions: unknown action 'jump'; this world knows W, S, A, D"),
    (["--observe", "7"], "--observe 7: must be a positive multiple of 12 video frames"),
    (["--revisit", "24"], "--revisit 24: a loop of whole chunks (12 video frames each) and at least 36 frames"),
    (["--revisit", "40"], "--revisit 40: a loop of whole chunks"),
    (["--world", "nope.jpg"], "cannot read the world photograph nope.jpg"),
    (["--actions", "D*40"], "more than the 576x384 photograph: pan less, or zoom in"),
    (["--actions", "W" + " " * 70000], "--actions: the action text is 70001 characters; at most 65536 are read"),
    (["--actions", "look(0.5,0)"], "--actions: look(0.5,0): the mouse moves [0.5, 0] a video frame; this world was "
                                   "trained within ±0.12"),
])
def test_the_world_refuses_bad_arguments_in_one_line(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fastar: error: ") and message in err[-1]
