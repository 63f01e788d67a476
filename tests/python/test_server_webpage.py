"""The chat page at / in headless Chromium, driven over the DevTools protocol.

A message is typed and sent, the answer streams in (the page counts the
deltas it received), the reasoning shows in its own element, and a screenshot
of the page is written to the test's temporary directory.
"""
import base64
import json
import re
import shutil
import subprocess
import time

import httpx
import pytest

from test_server_util import Server, chromium_path, make_model

websockets_sync = pytest.importorskip("websockets.sync.client")


class Page:
    """A minimal DevTools-protocol client for one page target."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg.get("result", {})

    def eval(self, expression):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = chromium_path()
    if not exe:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}",
                             "--window-size=1000,800", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    port = None
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
        if m:
            port = int(m.group(1))
            break
    if not port:
        proc.kill()
        pytest.fail("chromium did not start:\n" + "".join(lines))
    yield port
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(profile, ignore_errors=True)


def test_chat_page_streams_an_answer(browser, tmp_path_factory, ds4server):
    model = make_model(tmp_path_factory.mktemp("webpage") / "tiny.gguf")
    s = Server(model, think="--think")
    try:
        html = httpx.get(s.url + "/").text
        assert "<title>DS4Server chat</title>" in html and "/v1/chat/completions" in html
        targets = httpx.get(f"http://127.0.0.1:{browser}/json/list").json()
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        with websockets_sync.connect(ws_url, max_size=64 << 20, open_timeout=30) as ws:
            page = Page(ws)
            page.call("Page.enable")
            page.call("Page.navigate", url=s.url + "/")
            assert _wait(lambda: page.eval("document.readyState") == "complete" and
                         page.eval("!!document.getElementById('form')"))
            state = "JSON.stringify([...document.querySelectorAll('.assistant')].map(b => ({" \
                    "done: b.dataset.done || '', " \
                    "deltas: Number(b.dataset.deltas || 0), think: b.querySelector('.thinking').textContent, " \
                    "answer: b.querySelector('.answer').textContent, stats: b.querySelector('.stats').textContent})))"
            # Without thinking: the answer streams into the answer element.
            page.eval("document.getElementById('think').checked = false; document.getElementById('max').value = '12';"
                      "document.getElementById('input').value = 'Hello from the browser';"
                      "document.getElementById('form').requestSubmit(); true")
            assert _wait(lambda: json.loads(page.eval(state))[0]["done"] == "1")
            first = json.loads(page.eval(state))[0]
            assert first["answer"] and first["deltas"] >= 2 and first["think"] == ""
            assert "generated" in first["stats"], first
            # With thinking: the reasoning goes to its own element.
            page.eval("document.getElementById('think').checked = true; document.getElementById('max').value = '6';"
                      "document.getElementById('input').value = 'And now think';"
                      "document.getElementById('form').requestSubmit(); true")
            assert _wait(lambda: len(json.loads(page.eval(state))) == 2 and json.loads(page.eval(state))[1]["done"])
            second = json.loads(page.eval(state))[1]
            assert second["think"] and second["deltas"] >= 2
            user_bubbles = page.eval("document.querySelectorAll('.user').length")
            assert user_bubbles == 2
            shot = page.call("Page.captureScreenshot", format="png")["data"]
            out = tmp_path_factory.mktemp("screenshot") / "chat-page.png"
            out.write_bytes(base64.b64decode(shot))
            assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
            print(f"screenshot: {out}")
        # The page's two requests went through the real API, streamed.
        m = s.metrics()
        assert m['ds4_requests_total{api="chat.completions"}'] == 2
    finally:
        assert s.stop() == 0


def _wait(predicate, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if predicate():
                return True
        except (IndexError, KeyError):
            pass
        time.sleep(0.1)
    return False
