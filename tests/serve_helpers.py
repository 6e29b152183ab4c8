"""A real `decoderlm serve` in a subprocess on an ephemeral port, and a reader for its /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    """`python -m decoderlm serve ARGS --port 0`; `url` is its base URL once /health answers."""

    def __init__(self, *args: str, startup_timeout: float = 90) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "decoderlm", "serve", "--port", "0", *args], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            line = next((ln for ln in self.output().splitlines() if ln.startswith("serving ")), None)
            if line is not None:
                url = line.split(" on ", 1)[1].split("/v1")[0]
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not start within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM, as a service manager would; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class ThreadServer:
    """uvicorn in a thread of this process, serving `app` (for a model this process has loaded anyway)."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        from decoderlm.cli.serve import bind
        from decoderlm.serve.api import server_config

        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(server_config(app))  # as `decoderlm serve` runs
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def metrics(url: str) -> dict[str, float]:
    """Every sample on /metrics, keyed like `name{label="value"}` (labels sorted), or `name`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
