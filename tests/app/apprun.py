"""Start `python app.py` on the tiny pair in a subprocess, for end-to-end and browser tests."""
import os
import subprocess
import sys
import time
from pathlib import Path

from specdec_core.bench.startup import free_port

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "test-output"


class AppProcess:
    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        OUTPUT.mkdir(exist_ok=True)
        self.log = open(OUTPUT / f"app-{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "app.py", "--pair", "tiny", "--dtype", "float32",
                                      "--port", str(self.port), *args],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})})

    def client(self, timeout: float = 120):
        """A gradio_client once the app answers and its pair is loaded."""
        from gradio_client import Client

        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, (OUTPUT / f"app-{self.port}.log").read_text()
            try:
                client = Client(self.url, verbose=False)
                client.predict("ping", max_new_tokens=1, api_name="/generate")
                return client
            except Exception:
                time.sleep(0.5)
        raise TimeoutError("the app did not become ready")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
