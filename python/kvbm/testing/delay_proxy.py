"""A TCP proxy on 127.0.0.1 that delays every chunk a client sends (each S3
request, for an S3 client) by a set time: G4 made slower by a known amount,
in front of a real S3 server (kvbm.testing.s3server). Used by the
load-policy e2e test and bench/load_policy.py."""

from __future__ import annotations

import socket
import threading
import time


class DelayProxy:
    """Forwards 127.0.0.1:port to upstream; each chunk from a client waits
    `delay` seconds first (per connection, in order). `delay` may be changed
    while it runs."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.delay = 0.0
        self._ls = socket.socket()
        self._ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._ls.bind(("127.0.0.1", 0))
        self._ls.listen(64)
        self.port: int = self._ls.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._ls.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                c.close()
                continue
            threading.Thread(target=self._pump, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if delayed and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._ls.close()
