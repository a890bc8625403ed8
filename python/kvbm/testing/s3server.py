"""A real S3-compatible server for tests: versitygw serving a local directory
(installed by .ci/s3-server.sh).

The server runs in its own session and is described by a state directory
(data, pid, port), so any process can stop or restart it::

    srv = S3Server.create(tmp_dir)   # picks a free port, starts it
    srv.stop(); srv.start()          # an outage and a recovery, same data
    S3Server.load(tmp_dir).stop()    # from another process (vllm_harness)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

ACCESS_KEY = "kvbmtest"
SECRET_KEY = "kvbmtestsecret"


def binary() -> str | None:
    """versitygw: $KVBM_VERSITYGW, PATH, then $(go env GOPATH)/bin."""
    p = os.environ.get("KVBM_VERSITYGW") or shutil.which("versitygw")
    if p:
        return p
    gopath = os.environ.get("GOPATH")
    if not gopath:
        try:
            gopath = subprocess.run(["go", "env", "GOPATH"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            gopath = ""
    for d in filter(None, gopath.split(os.pathsep)):
        c = os.path.join(d, "bin", "versitygw")
        if os.access(c, os.X_OK):
            return c
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


_KEY = re.compile(r"^[0-9a-f]{16}$")


def count_objects(state_dir: str, bucket: str) -> int:
    """kvbm G4 objects (g4v2-<fingerprint>/<sequence hash>, and salted ones
    under g4v2-s<tag>/<fingerprint>/) stored in bucket."""
    return len(object_files(state_dir, bucket))


def object_files(state_dir: str, bucket: str) -> list[str]:
    """Paths of the kvbm G4 objects stored in bucket (posix backend)."""
    root = os.path.join(state_dir, "data", bucket)
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        if d != root:
            out += [os.path.join(d, n) for n in sorted(files) if _KEY.match(n)]
    return out


class S3Server:
    def __init__(self, state_dir: str, port: int, bin_path: str):
        self.state_dir, self.port, self.bin = state_dir, port, bin_path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, bucket: str = "kvbm-g4") -> dict:
        """The DYN_KVBM_OBJECT_* variables that point kvbm at this server."""
        return {"DYN_KVBM_OBJECT_ENABLED": "1", "DYN_KVBM_OBJECT_ENDPOINT": self.endpoint,
                "DYN_KVBM_OBJECT_BUCKET": bucket, "DYN_KVBM_OBJECT_ACCESS_KEY": ACCESS_KEY,
                "DYN_KVBM_OBJECT_SECRET_KEY": SECRET_KEY}

    @classmethod
    def create(cls, state_dir: str) -> "S3Server":
        b = binary()
        if b is None:
            raise FileNotFoundError("versitygw not found: run .ci/s3-server.sh")
        os.makedirs(os.path.join(state_dir, "data"), exist_ok=True)
        srv = cls(state_dir, _free_port(), b)
        with open(os.path.join(state_dir, "server.json"), "w") as f:
            json.dump({"port": srv.port, "bin": b}, f)
        srv.start()
        return srv

    @classmethod
    def load(cls, state_dir: str) -> "S3Server":
        with open(os.path.join(state_dir, "server.json")) as f:
            d = json.load(f)
        return cls(state_dir, d["port"], d["bin"])

    def _pidfile(self) -> str:
        return os.path.join(self.state_dir, "pid")

    def start(self, timeout: float = 30) -> None:
        env = dict(os.environ, ROOT_ACCESS_KEY=ACCESS_KEY, ROOT_SECRET_KEY=SECRET_KEY)
        log = open(os.path.join(self.state_dir, "server.log"), "ab")
        p = subprocess.Popen([self.bin, "--port", f"127.0.0.1:{self.port}", "--quiet", "posix",
                              os.path.join(self.state_dir, "data")],
                             env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        with open(self._pidfile(), "w") as f:
            f.write(str(p.pid))
        end = time.time() + timeout
        while not _listening(self.port):
            if p.poll() is not None or time.time() > end:
                raise RuntimeError(f"versitygw did not listen on port {self.port} (exit {p.poll()}); "
                                   f"see {self.state_dir}/server.log")
            time.sleep(0.02)

    def stop(self, timeout: float = 30) -> None:
        """Kill the server (an outage: nothing is flushed); data stays."""
        try:
            with open(self._pidfile()) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        end = time.time() + timeout
        while time.time() < end:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        os.unlink(self._pidfile())
