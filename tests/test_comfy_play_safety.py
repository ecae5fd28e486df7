"""FAST-AR World Play against what a hostile or careless client does, through a real ComfyUI server
(``COMFYUI_PATH``): action text built to stall a backtracking reader, out-of-range mouse moves, malformed
page messages, a bystander client, a prompt without a client, a page that never opens. The server keeps
answering, the session and its replay stay whole, the token stays with the client that queued it."""
import asyncio
import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from comfyui_fastar.fastar.actions import MAX_LIVE_TEXT, MAX_TEXT
from comfyui_fastar.testing import comfy_harness, play_client

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.comfyui
aiohttp = pytest.importorskip("aiohttp")  # ComfyUI's own: every tree these tests run against has it
L = MAX_TEXT


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import os

    if not os.environ.get("COMFYUI_PATH"):
        pytest.skip("COMFYUI_PATH names no ComfyUI tree")
    base = tmp_path_factory.mktemp("comfy_play_safety")
    with comfy_harness.comfy_server(base, REPO) as url_port:
        yield {**url_port, "base": base}


def _graph(actions: str | None = None, page_wait: float = 300.0) -> dict:
    graph = {
        "1": {"class_type": "FastARWorldModel", "inputs": {"world": "world.safetensors (the pack's)"}},
        "2": {"class_type": "FastARWorldPlay", "inputs": {"world": ["1", 0], "seed": 5, "max_seconds": 60.0,
                                                          "observe": 12, "page_wait": page_wait}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": f"s_{uuid.uuid4().hex[:8]}"}},
    }
    if actions is not None:
        graph["4"] = {"class_type": "FastARActionSchedule", "inputs": {"actions": actions}}
        graph["2"]["inputs"]["actions"] = ["4", 0]
    return graph


class Poller:
    """Asks ``/system_stats`` every 50 ms while it runs: the longest answer, an unanswered one included, is how
    long the server stalled."""

    def __init__(self, http, url):
        self.http, self.url, self.worst, self.count, self.asked = http, url, 0.0, 0, None

    async def run(self):
        while True:
            self.asked = time.perf_counter()
            async with self.http.get(self.url + "/system_stats") as r:
                assert r.status == 200
                await r.read()
            self.worst, self.asked = max(self.worst, time.perf_counter() - self.asked), None
            self.count += 1
            await asyncio.sleep(0.05)

    async def stop(self, polling):
        """Lets one more answer come (a stalled server is caught even if the work ended first), then stops."""
        done = self.count
        for _ in range(200):
            if self.count > done or (self.asked and time.perf_counter() - self.asked > 2.0):
                break
            await asyncio.sleep(0.05)
        if self.asked:
            self.worst = max(self.worst, time.perf_counter() - self.asked)
        polling.cancel()


async def _open(http, server, graph, client_id):
    """Queues a live graph for ``client_id`` (listening on /ws) and returns (that ws, the page's socket
    address, the token, the events so far)."""
    comfy = await http.ws_connect(f"ws://127.0.0.1:{server['port']}/ws?clientId={client_id}")
    async with http.post(server["url"] + "/prompt", json={"prompt": graph, "client_id": client_id}) as r:
        assert r.status == 200, await r.text()
    events = []
    while True:
        m = json.loads((await comfy.receive(timeout=120)).data)
        events.append(m)
        if m["type"] == "fastar.play":
            page = server["url"] + m["data"]["url"]
            break
    token = page.split("?token=")[1]
    return comfy, page.replace("http://", "ws://").replace("?token=", "/ws?token="), token, events


async def _until(ws, kind, timeout=120):
    """The page socket's JSON messages up to the first of ``kind`` (frames skipped)."""
    seen = []
    while True:
        msg = await ws.receive(timeout=timeout)
        if msg.type == aiohttp.WSMsgType.BINARY:
            continue
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        m = json.loads(msg.data)
        seen.append(m)
        if m["type"] == kind:
            return seen


async def _finish(comfy, events):
    while not any(e["type"] == "executing" and e["data"].get("node") is None for e in events):
        msg = await comfy.receive(timeout=120)
        if msg.type == aiohttp.WSMsgType.TEXT:
            events.append(json.loads(msg.data))
    await comfy.close()
    return events


ADVERSARIAL = {  # a backtracking reader takes from seconds to hours on each
    "spaces": "W" + " " * (L - 2) + "!", "letters": "a" * (L - 1) + "!", "plus": "W" + "+" * (L - 1),
    "unclosed": ("look(0.1," * L)[:L], "commas_in_parens": "(" + "," * (L - 1), "items_then_bad": ("W*1f," * L)[:L - 4] + "W*1x",
}


def test_adversarial_action_text_stalls_nothing(server):
    """Such text at the limit through /prompt (an Action Schedule, no token needed) and a play socket, with
    a bystander asking /system_stats all along: every answer within 2 s, each text refused by name, one over
    the limit refused by its length, and the socket open throughout."""
    async def run():
        async with aiohttp.ClientSession() as http:
            poller = Poller(http, server["url"])
            polling = asyncio.ensure_future(poller.run())
            refused = {}
            for name, text in {**ADVERSARIAL, "over": "W," * (L // 2) + "W"}.items():
                async with http.post(server["url"] + "/prompt", json={"prompt": _graph(text)}) as r:
                    body = await r.json()
                    assert r.status == 400, (name, body)
                    refused[name] = json.dumps(body["node_errors"])
            comfy, socket, _, events = await _open(http, server, _graph(), uuid.uuid4().hex)
            async with http.ws_connect(socket) as ws:
                await _until(ws, "hello")
                for text in ADVERSARIAL.values():
                    await ws.send_str(json.dumps({"action": text[:60000]}))
                await ws.send_str(json.dumps({"action": "D", "id": 1}))
                answers = await _until(ws, "ack")
                await ws.send_str(json.dumps({"stop": True}))
                await _until(ws, "end")
            await _finish(comfy, events)
            await poller.stop(polling)
            return refused, answers, poller
    refused, answers, poller = asyncio.run(run())
    assert poller.count >= 2 and poller.worst < 2.0, poller.worst  # a hang guard: a linear reader stalls ~ms
    assert "at most 65536 are read" in refused["over"]
    for name in ADVERSARIAL:
        assert "cannot read" in refused[name] or "unknown action" in refused[name], (name, refused[name][:300])
    errors = [a["message"] for a in answers if a["type"] == "error"]
    assert len(errors) == len(ADVERSARIAL) and all(f"at most {MAX_LIVE_TEXT} are read" in e for e in errors)
    assert answers[-1]["type"] == "ack" and answers[-1]["id"] == 1  # the socket stayed open and in use


def test_an_out_of_range_mouse_is_refused_and_the_session_and_its_replay_stay_whole(server):
    bad = ["look(1e40,0)", "look(1" + "0" * 40 + ",0)", "look(nan,0)", "look(0,inf)", "look(0.5,0)", "W+look(0,-0.2)"]

    def plan(m):
        if m["chunk"] == -1:
            return [{"action": b} for b in bad] + [{"action": "D+look(0.05,-0.1)", "id": 1}]
        return [{"stop": True}] if m["chunk"] >= 2 else []

    got, events = asyncio.run(play_client.session(server["url"], server["port"], _graph(), plan))
    messages = [e["message"] for e in got["errors"]]
    assert len(messages) == len(bad) and got["acks"][0]["id"] == 1
    assert sum("cannot read" in m for m in messages) == 3 and sum("trained within ±0.12" in m for m in messages) == 3
    live = play_client.saved(server["base"], events, "3").astype(float)
    assert np.isfinite(live).all() and live[12:].std() > 10  # frames, not a poisoned cache's black
    log = got["end"]["log"]
    assert "D+look(0.05,-0.1)*" in log
    _, replay = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"], _graph(log), timeout=300))
    assert np.array_equal(play_client.saved(server["base"], replay, "3").astype(float), live)


def test_the_token_stays_with_the_client_that_queued_the_session(server):
    """A bystander on /ws sees no token; the server's log (/internal/logs/raw, and its output) says the
    session is open, without the token; a live session queued with no client is refused by name."""
    async def run():
        async with aiohttp.ClientSession() as http:
            bystander = await http.ws_connect(f"ws://127.0.0.1:{server['port']}/ws?clientId={uuid.uuid4().hex}")
            comfy, socket, token, events = await _open(http, server, _graph(), uuid.uuid4().hex)
            async with http.ws_connect(socket) as ws:
                await _until(ws, "chunk")
                async with http.get(server["url"] + "/internal/logs/raw") as r:
                    logs = json.dumps(await r.json())
                await ws.send_str(json.dumps({"stop": True}))
                await _until(ws, "end")
            await _finish(comfy, events)
            seen = []
            while True:
                try:
                    msg = await bystander.receive(timeout=1.0)
                except asyncio.TimeoutError:
                    break
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                seen.append(msg.data)
            await bystander.close()
            # no client: refused when the node runs (its error goes to every client, so the bystander's
            # history shows it)
            async with http.post(server["url"] + "/prompt", json={"prompt": _graph()}) as r:
                prompt_id = (await r.json())["prompt_id"]
            for _ in range(600):
                async with http.get(server["url"] + f"/history/{prompt_id}") as r:
                    history = await r.json()
                if history:
                    break
                await asyncio.sleep(0.1)
            return token, events, logs, seen, history[prompt_id]
    token, events, logs, seen, history = asyncio.run(run())
    assert seen and not [m for m in seen if token in m] and not [m for m in seen if "fastar.play" in m]
    assert "is open; its page's address went to the client that queued it" in logs and token not in logs
    assert token not in (server["base"] / "server.log").read_text()
    status = json.dumps(history["status"])
    assert history["status"]["status_str"] == "error" and "pass client_id with /prompt" in status


def test_malformed_page_messages_are_answered_on_a_socket_that_stays_open_and_closes_at_the_end(server):
    async def run():
        async with aiohttp.ClientSession() as http:
            comfy, socket, _, events = await _open(http, server, _graph(), uuid.uuid4().hex)
            async with http.ws_connect(socket) as ws:
                await _until(ws, "hello")
                for text in ("[1]", "null", '"W"', "{}", "not json", '{"action": 5}', '{"id": 3}'):
                    await ws.send_str(text)
                await ws.send_bytes(b"\x00\x01")
                await ws.send_str(json.dumps({"action": "D", "id": 2}))
                answers = await _until(ws, "ack")
                await ws.send_str(json.dumps({"stop": True}))
                await _until(ws, "end")
                rest = []
                while True:  # after the end the server closes the socket
                    msg = await ws.receive(timeout=30)
                    rest.append(msg.type)
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                        break
            async with http.get(socket.replace("ws://", "http://")) as r:
                after = r.status  # the ended session's socket is refused
            await _finish(comfy, events)
            return answers, rest, after
    answers, rest, after = asyncio.run(run())
    errors = [a["message"] for a in answers if a["type"] == "error"]
    assert len(errors) == 8 and answers[-1]["id"] == 2
    assert sum("a JSON object" in e for e in errors) == 6 and any("action is text" in e for e in errors)
    assert any("not binary" in e for e in errors) and all(e.startswith("FAST-AR World Play: ") for e in errors)
    assert rest[-1] in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
    assert after == 403


def test_a_session_whose_page_never_opens_ends_after_page_wait(server):
    async def run():
        async with aiohttp.ClientSession() as http:
            t0 = time.perf_counter()
            comfy, _, _, events = await _open(http, server, _graph(page_wait=10.0), uuid.uuid4().hex)
            events = await _finish(comfy, events)
            elapsed = time.perf_counter() - t0
            async with http.get(server["url"] + "/internal/logs/raw") as r:
                logs = json.dumps(await r.json())
            return events, elapsed, logs
    events, elapsed, logs = asyncio.run(run())
    assert not [e for e in events if e["type"] == "execution_error"]
    assert 10.0 <= elapsed < 120.0
    (out,) = [e["data"]["output"] for e in events if e["type"] == "executed" and e["data"]["node"] == "2"]
    assert out["text"] == ["idle*12f"]  # the frames shown first only: no chunk was played unseen
    assert "waits for its page (it ends after 10 s)" in logs and "ends: no page for 10 s" in logs
