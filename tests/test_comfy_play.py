"""FAST-AR World Play through a real ComfyUI server (``COMFYUI_PATH``): a session opened by /prompt, played
over its socket (actions in, frames out), stopped, and its action log replayed offline to the same frames;
requests without the session's token refused. The pack's world on the CPU: no model file."""
import asyncio
import json
import os
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

from comfyui_fastar.testing import comfy_frontend, comfy_harness, play_client

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.comfyui
COMFYUI_PATH = os.environ.get("COMFYUI_PATH")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not COMFYUI_PATH:
        pytest.skip("COMFYUI_PATH names no ComfyUI tree")
    base = tmp_path_factory.mktemp("comfy_play")
    with comfy_harness.comfy_server(base, REPO) as url_port:
        yield {**url_port, "base": base}


def _graph(prefix: str, actions: str | None = None, max_seconds: float = 60.0) -> dict:
    graph = {
        "1": {"class_type": "FastARWorldModel", "inputs": {"world": "world.safetensors (the pack's)"}},
        "2": {"class_type": "FastARWorldPlay", "inputs": {"world": ["1", 0], "seed": 3, "max_seconds": max_seconds,
                                                          "observe": 12}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    }
    if actions is not None:
        graph["4"] = {"class_type": "FastARActionSchedule", "inputs": {"actions": actions}}
        graph["2"]["inputs"]["actions"] = ["4", 0]
    return graph


def saved(server, events, node: str = "3") -> np.ndarray:
    return play_client.saved(server["base"], events, node)


async def session(server, plan, graph=None):
    """The pack's world's live graph (or ``graph``) played by ``plan``: ``play_client.session``."""
    return await play_client.session(server["url"], server["port"], graph or _graph(f"play_{uuid.uuid4().hex[:8]}"),
                                     plan)


def test_a_session_plays_the_actions_as_they_come_and_its_log_replays_it(server):
    def plan(m):  # press D, then a mouse look with W, a key this world lacks, idle, then stop
        return {-1: [{"action": "D", "id": 1}], 1: [{"action": "W+look(0.05,-0.03)", "id": 2}],
                2: [{"action": "jump", "id": 3}], 3: [{"action": "idle", "id": 4}],
                5: [{"stop": True}]}.get(m["chunk"], [])

    got, events = asyncio.run(session(server, plan))
    assert got["refused"] == [403] * 5
    assert got["page"][0] == 200 and "FAST-AR World Play" in got["page"][1]
    assert got["hello"]["world"] == "the pack's world" and ["W", "W", "pan up"] in got["hello"]["keys"]
    assert got["end"]["reason"] == "stopped"
    chunks = got["chunks"]
    # stopped after the chunk it arrived during (or, arriving between chunks, the one before)
    assert [c["chunk"] for c in chunks] == list(range(len(chunks))) and len(chunks) in (6, 7)
    # every chunk took the latest action that had arrived when it started (the server's clock, one per post)
    acks = got["acks"]
    assert [a["seq"] for a in acks] == [1, 2, 3] and [a["id"] for a in acks] == [1, 2, 4]
    for c in chunks:
        assert c["seq"] == max([a["seq"] for a in acks if a["received"] < c["taken"]], default=0), (c, acks)
    assert any(c["seq"] == 1 for c in chunks) and any(c["seq"] == 2 for c in chunks)
    (error,) = got["errors"]
    assert error["message"].startswith("FAST-AR World Play: unknown action 'jump'")
    # the frames in order: the 12 the world was shown first (sent with hello, before any chunk), a chunk's 12 each
    assert got["hello"]["first"] == 12 and got["frames"] == list(range(12 + 12 * len(chunks)))
    assert all(c["frames"] == [12 + 12 * i, 12] for i, c in enumerate(chunks))
    assert chunks[-1]["cache"]["tokens"] > 0 and chunks[-1]["cache"]["dense_tokens"] > 0
    live = saved(server, events)
    assert live.shape == (12 + 12 * len(chunks), 64, 64, 3)
    log = got["end"]["log"]
    (play,) = [e["data"]["output"] for e in events if e["type"] == "executed" and e["data"]["node"] == "2"]
    assert play["text"] == [log]
    assert log.startswith("idle*") and re.search(r"(^|, )D\*\d+f", log) and "W+look(" in log
    # the log, as an Action Schedule, replays the session with no page: the same frames
    _, replay_events = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"],
                                                            _graph(f"replay_{uuid.uuid4().hex[:8]}", log), timeout=300))
    assert not [e for e in replay_events if e["type"] == "execution_error"]
    assert np.array_equal(saved(server, replay_events), live)


def test_a_closed_page_pauses_the_session_until_it_opens_again(server):
    """The page closes for 3 s after chunk 1: the session plays at most the chunk already under way (its
    frames unseen), waits, and goes on where it was once the page is back (its frames and log whole)."""
    def plan(m):
        if m["chunk"] == 1:
            return [{"away": 3.0}]
        return [{"stop": True}] if m["chunk"] >= 3 else []

    got, events = asyncio.run(session(server, plan))
    assert len(got["hellos"]) == 2 and got["end"]["reason"] == "stopped"
    chunks = {c["chunk"]: c for c in got["chunks"]}
    last = max(chunks)
    assert len(set(range(last + 1)) - set(chunks)) <= 1, sorted(chunks)  # played while no page was open
    taken = sorted(c["taken"] for c in chunks.values())
    assert max(b - a for a, b in zip(taken, taken[1:])) >= 2.5  # it waited for the page
    assert saved(server, events).shape[0] == 12 + 12 * (last + 1)
    assert got["end"]["log"] == f"idle*{12 + 12 * (last + 1)}f"


def test_restart_plays_the_world_from_its_start(server):
    seen = []

    def plan(m):
        seen.append(m["chunk"])
        if m["chunk"] == -1:
            return [{"action": "A"}]
        if len(seen) == 3:  # chunk 1 shown: from the start again
            return [{"restart": True}]
        return [{"stop": True}] if seen.count(0) == 2 and m["chunk"] == 1 else []

    got, events = asyncio.run(session(server, plan))
    chunks = [c["chunk"] for c in got["chunks"]]
    restart = chunks.index(0, 1)
    assert len(got["restarts"]) == 1
    assert restart in (2, 3) and chunks == list(range(restart)) + list(range(len(chunks) - restart)), chunks
    assert got["end"]["reason"] == "stopped"
    played = len(chunks) - restart
    assert saved(server, events).shape == (12 + played * 12, 64, 64, 3)  # the restarted run's frames
    # its log: A, held across the restart, from the restarted run's first chunk
    assert got["end"]["log"] == f"idle*12f, A*{12 * played}f"


PLAY_WORKFLOW = REPO / "example_workflows" / "FAST-AR - play the world live (no download).json"


def test_the_play_template_is_the_live_graph_at_its_defaults(server):
    """The template as ComfyUI reads it: the pack's world, TempCache at its defaults, a live session (nothing
    on actions) of at most a minute, its frames saved."""
    from comfyui_fastar.fastar import TempCacheConfig

    info = comfy_harness.get_json(server["url"] + "/object_info")
    prompt = comfy_harness.api_prompt(json.loads(PLAY_WORKFLOW.read_text()), info)
    by_type = {n["class_type"]: n["inputs"] for n in prompt.values()}
    play = by_type["FastARWorldPlay"]
    assert {k: v for k, v in play.items() if not isinstance(v, list)} == {
        "seed": 0, "max_seconds": 60.0, "observe": 12, "width": 640, "height": 352, "page_wait": 300.0}
    assert set(k for k, v in play.items() if isinstance(v, list)) == {"world", "cache"}
    t = TempCacheConfig()
    assert by_type["FastARTempCacheSettings"] == {"enabled": t.enabled, "merge_threshold": t.merge_threshold,
                                                  "max_cache_frames": t.max_cache_frames, "sink_frames": t.sink_frames,
                                                  "recall_frames": t.recall_frames}
    assert "SaveAnimatedWEBP" in by_type


def _webp_frames(path, fps: float = 16.0) -> list[np.ndarray]:
    """An animated WEBP's frames at ``fps`` (its encoder keeps one frame, held longer, for a run of equal ones)."""
    from PIL import Image, ImageSequence

    frames = []
    with Image.open(path) as im:
        for f in ImageSequence.Iterator(im):
            frames += [np.asarray(f.convert("RGB"), float)] * round(f.info["duration"] * fps / 1000)
    return frames


def _shift(a: np.ndarray, b: np.ndarray, r: int = 20) -> int:
    """How far right the camera moved from frame a to frame b, in pixels: b(x) ~ a(x + dx)."""
    w = a.shape[1]
    errs = {dx: np.abs(b[:, :w - dx] - a[:, dx:]).mean() if dx >= 0 else np.abs(b[:, -dx:] - a[:, :w + dx]).mean()
            for dx in range(-r, r + 1)}
    return min(errs, key=errs.get)


def _pans(server, log: str, held: str) -> list[int]:
    """How far right the camera moved over each latent frame's worth (4 video frames) that ``held`` was held for
    from start to end, in the frames the last session saved (the template's animated WEBP)."""
    from comfyui_fastar.fastar.actions import ActionSpec, parse_actions

    rows = parse_actions(log, ActionSpec(), 12)
    frames = _webp_frames(max((server["base"] / "output" / "fastar").glob("world_play*.webp"), key=os.path.getmtime))
    assert len(frames) == len(rows)
    row = parse_actions(held, ActionSpec(), 1)[0]
    return [_shift(frames[i], frames[i + 4]) for i in range(12, len(rows) - 4, 4) if (rows[i:i + 5] == row).all()]


PLAY_NODE = "window.app.graph._nodes.find((n) => n.type === 'FastARWorldPlay')"
SNAP = ("() => [window.__fastar.shown, Array.from(document.getElementById('screen').getContext('2d')"
        ".getImageData(0, 0, 64, 64).data)]")  # the frame shown's number and its pixels
SAVED = "() => window.app.graph._nodes.find((n) => n.type === 'SaveAnimatedWEBP')?.imgs?.length > 0"
FIELDS = "() => Object.fromEntries([...document.querySelectorAll('[data-field]')].map((e) => [e.dataset.field, " \
         "e.textContent]))"
# a gamepad the test moves: navigator.getGamepads() returns it, its axes and buttons set through window.__pad
SCRIPTED_PAD = """(() => { const pad = { id: "scripted pad", index: 0, connected: true, mapping: "standard",
    timestamp: 0, axes: [0, 0, 0, 0], buttons: Array.from({ length: 17 }, () => ({ pressed: false, value: 0 })) };
  window.__pad = pad;
  Object.defineProperty(navigator, "getGamepads", { value: () => [pad, null, null, null], configurable: true });
})();"""


def _load(page) -> None:
    """The live template in the frontend, as a user loads it."""
    page.evaluate("(wf) => window.app.loadGraphData(wf)", json.loads(PLAY_WORKFLOW.read_text()))
    page.wait_for_timeout(800)
    page.evaluate(comfy_frontend.CLOSE_DIALOGS)


def _open_play(page, errors: list):
    """The loaded template queued from the frontend, its page opened by the node's button (its script's
    errors into ``errors``)."""
    page.evaluate("() => window.app.queuePrompt(0)")
    page.wait_for_function(f"() => !!{PLAY_NODE}.fastarPlayUrl", timeout=120000)
    with page.expect_popup() as popup:
        page.evaluate(f"() => {PLAY_NODE}.fastarPlayButton.callback()")
    popup.value.on("pageerror", lambda e: errors.append(str(e)))
    return popup.value


def _download(play, link: str) -> bytes:
    """What the page's download link ``link`` gives, downloaded as a user does."""
    with play.expect_download() as download:
        play.click(link)
    return Path(download.value.path()).read_bytes()


def _size_widgets(page) -> dict:
    """World Play's width / height widgets: hidden or not, and the node's height."""
    return page.evaluate(f"""() => {{ const n = {PLAY_NODE};
        return {{ hidden: n.widgets.filter((w) => ['width', 'height'].includes(w.name)).map((w) => !!w.hidden),
                  height: n.size[1] }}; }}""")


@pytest.mark.skipif(comfy_frontend.chromium() is None, reason="no Chromium here")
def test_the_play_template_plays_in_the_frontend(server):
    """The live template as a user plays it: queued from the frontend, the node's button opens the play page;
    the frames shown first appear at once while the page says it makes the first chunk; a key held moves the
    world (the trained world pans over its photograph), the legend says what each key does, the numbers are
    shown; a recording and the action log download; stop ends the session with the frames saved on the graph
    and the node's button no longer opens the page. The size widgets show only for a world that uses them."""
    sync_api = pytest.importorskip("playwright.sync_api")
    errors = []
    with sync_api.sync_playwright() as p:
        browser, page = comfy_frontend.frontend(p, server["url"], sync_api, COMFYUI_PATH)
        try:
            _load(page)
            label = page.evaluate(f"() => {PLAY_NODE}.fastarPlayButton.label")
            pack_world = _size_widgets(page)
            play = _open_play(page, errors)
            # the first frame drawn: a frame shown first, not black, while the first chunk is made
            start = play.wait_for_function("""() => { const s = window.__fastar;
                if (!s || s.drawn < 1) return null;
                const px = document.getElementById('screen').getContext('2d').getImageData(0, 0, 64, 64).data;
                return [s.status, s.shown, px.some((v, i) => i % 4 < 3 && v > 0)]; }""", timeout=120000).json_value()
            play.wait_for_function("() => window.__fastar.drawn >= 36", timeout=120000)
            statuses = play.evaluate("() => window.__fastar.statuses")
            idle = play.evaluate(SNAP)
            play.keyboard.down("d")
            play.wait_for_function("""() => { const s = window.__fastar, c = s.chunks.find((c) => c.seq >= 1);
                                              return c && s.drawn >= c.frames[0] + c.frames[1] - 12 + 12; }""",
                                   timeout=60000)
            moved = play.evaluate(SNAP)
            play.keyboard.up("d")
            play.wait_for_function("() => window.__fastar.latencies.length > 1", timeout=60000)
            drawn = play.evaluate("() => window.__fastar.drawn")
            play.click("#record")  # a second of frames recorded
            play.wait_for_function(f"() => window.__fastar.recording && window.__fastar.drawn >= {drawn + 16}",
                                   timeout=60000)
            play.click("#record")
            play.wait_for_selector("#download-video", timeout=30000)
            video = _download(play, "#download-video")
            shown = play.evaluate(FIELDS)
            legend = play.text_content("#legend")
            play.set_viewport_size({"width": 860, "height": 520})
            comfy_frontend.screenshot(play, "world_play.png")
            play.click("#stop")
            play.wait_for_function("() => window.__fastar.end !== null", timeout=60000)
            end = play.evaluate("() => window.__fastar.end")
            log = _download(play, "#download-log").decode()
            page.wait_for_function(SAVED, timeout=120000)
            page.wait_for_function(f"() => {PLAY_NODE}.fastarPlayButton.label.startsWith('session ended')",
                                   timeout=30000)
            ended = page.evaluate(f"""() => {{ const n = {PLAY_NODE}, open = window.open; let opened = 0;
                window.open = () => {{ opened += 1; return null; }};
                try {{ n.fastarPlayButton.callback(); }} finally {{ window.open = open; }}
                return [n.fastarPlayButton.label, opened]; }}""")
            # Matrix-Game 2.0's loader on the world input: its size widgets are shown again
            page.evaluate(f"""() => {{ const n = {PLAY_NODE}, mg = LiteGraph.createNode('FastARMatrixGameLoader');
                window.app.graph.add(mg); mg.connect(0, n, n.inputs.findIndex((i) => i.name === 'world')); }}""")
            matrix_game = _size_widgets(page)
        finally:
            browser.close()
    assert not errors and label == "open the play page (queue first)"
    assert ended == ["session ended: queue again to play", 0]
    assert pack_world["hidden"] == [True, True] and matrix_game["hidden"] == [False, False]
    assert matrix_game["height"] > pack_world["height"] + 30, (pack_world, matrix_game)
    status, first_shown, lit = start
    assert status == "making the first chunk…" and first_shown < 12 and lit, start
    # the page said it made the first chunk until the chunk's own frames were drawn, after the 12 shown first
    texts = [s["text"] for s in statuses]
    assert texts[:2] == ["connecting…", "making the first chunk…"] and statuses[1]["drawn"] == 0, statuses
    playing = statuses[texts.index("playing")]
    assert playing["shown"] >= 12 and playing["drawn"] >= 13, statuses
    assert end["reason"] == "stopped" and "D*" in end["log"] and log == end["log"]
    assert video[:4] == b"\x1a\x45\xdf\xa3" and len(video) > 1000  # a webm (EBML) file, not empty
    # what the page showed moved; the frames played (saved by the graph) pan right while D was held, and
    # stand still while nothing was: a latent frame's worth (4 video frames) at a time
    (before, before_pixels), (after, after_pixels) = idle, moved
    assert after > before and before_pixels != after_pixels
    pans = {held: _pans(server, end["log"], held) for held in ("D", "idle")}
    assert pans["D"] and np.mean(pans["D"]) >= 6 and pans["idle"] and abs(np.mean(pans["idle"])) <= 2, pans
    for said in ("pan up", "pan down", "pan left", "pan right", "zoom in", "zoom out", "look around", "pause"):
        assert said in legend, legend
    assert "W -> W" not in legend and "WW" not in legend, legend
    assert float(shown["generated"]) > 0 and float(shown["drawn"]) > 0, shown
    assert re.fullmatch(r"median \d+ ms, 95% \d+ ms \(\d+\)", shown["latency"]), shown
    assert "tokens" in shown["cache"] and shown["dense"].endswith("tokens") and shown["gpu"] == "CPU", shown
    assert shown["action"] == "idle", shown


@pytest.mark.skipif(comfy_frontend.chromium() is None, reason="no Chromium here")
def test_the_play_page_pauses_and_a_gamepad_steers_in_the_frontend(server):
    """A gamepad steers the world: its left stick holds D (the world pans right), its right stick looks, its Y
    button pauses: the session stops between chunks and both frames-a-second figures decay to 0; P resumes.
    A page that falls behind drops its oldest frames beyond two chunks instead of lagging further."""
    sync_api = pytest.importorskip("playwright.sync_api")
    errors = []
    with sync_api.sync_playwright() as p:
        browser, page = comfy_frontend.frontend(p, server["url"], sync_api, COMFYUI_PATH, init_script=SCRIPTED_PAD)
        try:
            _load(page)
            play = _open_play(page, errors)
            play.wait_for_function("() => window.__fastar.drawn >= 24", timeout=120000)
            before = play.evaluate(SNAP)
            play.evaluate("() => { window.__pad.axes[0] = 1; }")  # the left stick to the right
            play.wait_for_function("() => window.__fastar.action === 'D'", timeout=10000)
            play.wait_for_function("""() => { const s = window.__fastar, a = s.acks[s.acks.length - 1];
                const c = a && s.chunks.find((c) => c.seq >= a.seq);
                return c && s.drawn >= c.frames[0] + c.frames[1] + 12; }""", timeout=60000)
            after = play.evaluate(SNAP)
            play.evaluate("() => { window.__pad.axes[0] = 0; window.__pad.axes[2] = 1; }")  # the right stick right
            play.wait_for_function("() => window.__fastar.action === 'look(0,0.1)'", timeout=10000)
            play.wait_for_function("""() => { const s = window.__fastar, a = s.acks[s.acks.length - 1];
                return a && s.chunks.some((c) => c.seq >= a.seq); }""", timeout=60000)
            play.evaluate("() => { window.__pad.axes[2] = 0; }")
            play.wait_for_function("() => window.__fastar.action === 'idle'", timeout=10000)
            play.evaluate("() => { window.__pad.buttons[3].pressed = true; }")  # Y: pause
            play.wait_for_function("() => window.__fastar.paused === true", timeout=30000)
            play.evaluate("() => { window.__pad.buttons[3].pressed = false; }")
            paused_at = play.evaluate("() => window.__fastar.chunks.length")
            play.wait_for_function("() => { const r = window.__fastar.rates(); return r.generated === 0 "
                                   "&& r.drawn === 0; }", timeout=30000)
            play.wait_for_timeout(1000)  # the timer shows the rates every 0.25 s
            paused = play.evaluate(FIELDS), play.text_content("#status"), play.evaluate(
                "() => window.__fastar.chunks.length")
            play.keyboard.press("p")  # resume
            play.wait_for_function("() => window.__fastar.paused === false", timeout=30000)
            play.wait_for_function(f"() => window.__fastar.chunks.length >= {paused[2]} + 2", timeout=60000)
            play.wait_for_function("() => { const r = window.__fastar.rates(); return r.generated > 0 "
                                   "&& r.drawn > 0; }", timeout=30000)  # both figures up again
            # the page stops drawing (its animation frames held back): frames pile up, the oldest beyond two
            # chunks go; drawing again, it goes on from the newest
            play.evaluate("() => { window.__raf = window.requestAnimationFrame; window.__held = [];"
                          " window.requestAnimationFrame = (f) => window.__held.push(f); }")
            play.wait_for_function("() => window.__fastar.dropped > 0", polling=250, timeout=60000)
            behind = play.evaluate("() => [window.__fastar.queued(), window.__fastar.drawn]")
            play.evaluate("() => { window.requestAnimationFrame = window.__raf; window.__held.forEach(__raf); }")
            play.wait_for_function(f"() => window.__fastar.drawn > {behind[1]}", timeout=30000)
            play.click("#stop")
            play.wait_for_function("() => window.__fastar.end !== null", timeout=60000)
            end = play.evaluate("() => window.__fastar.end")
            page.wait_for_function(SAVED, timeout=120000)
        finally:
            browser.close()
    assert not errors
    fields, status, chunks_paused = paused
    assert status == "paused (P resumes)" and chunks_paused <= paused_at + 1  # the chunk under way, at most
    assert fields["generated"] == "0.0" and fields["drawn"] == "0.0", fields
    assert before[0] < after[0] and before[1] != after[1]
    assert behind[0] <= 24, behind  # two chunks at most wait to be drawn
    assert end["reason"] == "stopped" and "D*" in end["log"] and "look_right*" in end["log"], end["log"]
    pans = _pans(server, end["log"], "D")
    assert pans and np.mean(pans) >= 6, pans


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["wan", pytest.param("taehv", marks=pytest.mark.taehv)])
def test_the_play_benchmark_times_a_live_session_and_its_replay(comfy, tmp_path, decoder):
    """bench/play_bench.py --smoke: a live session (the pack's routes, a player on its socket) and its log
    played offline, each timed, decoded by the Wan VAE or a fast decoder; the file names the device, the
    shapes and the decoder."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import play_bench

    result = play_bench.main(["--comfyui", COMFYUI_PATH, "--smoke", "--chunks", "5", "--hold", "1", "--repeats", "1",
                              "--decoder", decoder, "--out", str(tmp_path)])
    name = "play_bench_taehv_smoke.json" if decoder == "taehv" else "play_bench_smoke.json"
    assert json.loads((tmp_path / name).read_text())["summary"] == result["summary"]
    assert result["settings"]["decoder"].startswith("the Wan 2.1 VAE" if decoder == "wan" else "a TAEHV")
    live, offline = result["summary"]["live"], result["summary"]["offline"]
    # how many posts a chunk takes depends on the CPU's timing (a pipelined chunk takes the action held when it
    # starts, one chunk ahead of the frames shown): at least the first
    assert live["frames"] == 9 + 12 * 4 and live["posts_timed"] >= 1
    assert 0 < live["key_to_frame_ms"] <= live["key_to_frame_max_ms"]
    assert live["fps"] > 0 and offline["fps"] > 0 and live["rollout_ms"] > 0 and offline["rollout_ms"] > 0
    # pipelined, a chunk's decode overlaps the next chunk's sampling: it is timed, not bounded by the period
    assert live["decode_ms"] > 0 and offline["decode_ms"] > 0 and result["settings"]["loop"] == "pipelined"
    assert result["shape"] == {"height": 48, "width": 64, "model": "tiny"}
    assert result["summary"]["replay_max_abs"] == [0.0]  # the CPU replays its session bit for bit
