"""Fixtures: a real idem serve, a proxy that loses replies, and a sink that
counts effects.

The tests need an idem binary: IDEM_BIN (cmd/idem's TestPythonClient sets
it, and IDEM_TEST_RUN_MAIN, to its own test binary; by hand:
``go build -o /tmp/idem ./cmd/idem && IDEM_BIN=/tmp/idem python3 -m pytest clients/python``).
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import queue
import subprocess
import sys
import threading
import urllib.parse
from typing import Dict, List, Optional

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class Idem:
    """``idem serve`` on an embedded etcd in its own directory, on free ports."""

    def __init__(self, workdir: str, *args: str, etcd: Optional["Idem"] = None):
        binary = os.environ.get("IDEM_BIN")
        if not binary:
            raise RuntimeError("set IDEM_BIN to an idem binary (go build -o /tmp/idem ./cmd/idem)")
        self.data = os.path.join(workdir, "data")
        # Its own embedded etcd, or (etcd) another idem's: a second process of one deployment.
        where = ["--data-dir", self.data, "--embedded-peer-url", "unix://peer.sock"] if etcd is None else \
            ["--endpoints", "unix://" + os.path.join(etcd.data, "etcd.sock")]
        cmd = [binary, "serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--log-format", "json", *where, *args]
        self.proc = subprocess.Popen(cmd, cwd=workdir, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.logs: List[str] = []
        ready: "queue.Queue[Optional[str]]" = queue.Queue()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.logs.append(line)
                try:
                    m = json.loads(line)
                except ValueError:
                    continue
                if m.get("msg") == "idem listening":
                    ready.put("http://" + m["listen"])
            ready.put(None)

        threading.Thread(target=read, daemon=True).start()
        try:
            url = ready.get(timeout=90)
        except queue.Empty:
            url = None
        if url is None:
            self.stop()
            raise RuntimeError("idem did not start:\n" + "".join(self.logs))
        self.url: str = url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def idem(tmp_path_factory: pytest.TempPathFactory):
    srv = Idem(str(tmp_path_factory.mktemp("idem")))
    yield srv
    srv.stop()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def _serve(handler: type) -> _Server:
    srv = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


class LossyProxy:
    """Forwards every request to ``target`` (a URL, or a list of them taken
    in turn, as a load balancer without affinity would) and, for the first
    request of each kind named in ``drop`` (a substring of "METHOD path"),
    reads idem's answer and then closes the connection without passing it
    on: a reply lost after idem acted."""

    def __init__(self, target, drop: List[str]):
        targets = [target] if isinstance(target, str) else list(target)
        self.targets = [urllib.parse.urlsplit(t) for t in targets]
        self.turn = 0
        self.pending = list(drop)
        self.dropped: List[str] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                with proxy.lock:
                    target = proxy.targets[proxy.turn % len(proxy.targets)]
                    proxy.turn += 1
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
                hdrs = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=hdrs)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                what = f"{self.command} {self.path}"
                with proxy.lock:
                    rule = next((d for d in proxy.pending if d in what and resp.status < 300), None)
                    if rule is not None:
                        proxy.pending.remove(rule)
                        proxy.dropped.append(rule)
                if rule is not None:
                    self.close_connection = True
                    self.connection.shutdown(2)  # idem answered; the caller never hears it
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _any

        self.server = _serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()


class Sink:
    """A downstream that applies each effect once by its idempotency key and
    refuses a fencing token lower than the highest it saw for the job."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.applied: Dict[str, int] = {}
        self.calls: Dict[str, List[int]] = {}
        self.highest: Dict[str, int] = {}
        self.entered = threading.Event()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                e = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = 200
                with sink.lock:
                    sink.calls.setdefault(e["key"], []).append(e["token"])
                    if e["token"] < sink.highest.get(e["job"], 0):
                        status = 409
                    else:
                        sink.highest[e["job"]] = e["token"]
                        sink.applied.setdefault(e["key"], 0)
                        if sink.applied[e["key"]] == 0:
                            sink.applied[e["key"]] = 1
                if e.get("enter"):
                    sink.entered.set()
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = _serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def sink():
    s = Sink()
    yield s
    s.close()
