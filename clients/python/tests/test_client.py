"""Idempotent calls through idem's sidecar: one key per operation, retried
with the same key; a replay recognised; a lost reply retried runs nothing
twice."""

import http.server
import json
import threading

import pytest

from conftest import Idem, LossyProxy, _serve
from idem import Client, ProblemError


class Upstream:
    def __init__(self):
        self.charges = []
        up = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                up.charges.append(json.loads(body))
                out = json.dumps({"charge": len(up.charges)}).encode()
                self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = _serve(H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    up = Upstream()
    srv = Idem(str(tmp_path_factory.mktemp("sidecar")), "--upstream", up.url)
    yield srv, up
    srv.stop()
    up.server.shutdown()


def test_a_lost_reply_retried_charges_once(sidecar):
    srv, up = sidecar
    proxy = LossyProxy(srv.url, ["POST /charges"])
    try:
        c = Client(proxy.url)
        r = c.call("POST", "/charges", json_body={"amount": 5})
        assert proxy.dropped == ["POST /charges"]
        assert r.status == 201 and r.replayed and r.json() == {"charge": len(up.charges)}
        assert [ch for ch in up.charges if ch == {"amount": 5}] == [{"amount": 5}]
        again = c.call("POST", "/charges", json_body={"amount": 5}, key=r.key)
        assert again.replayed and again.body == r.body
    finally:
        proxy.close()


def test_a_key_reused_with_other_parameters_is_refused(sidecar):
    srv, _ = sidecar
    c = Client(srv.url)
    r = c.call("POST", "/charges", json_body={"amount": 7})
    assert not r.replayed
    with pytest.raises(ProblemError) as e:
        c.call("POST", "/charges", json_body={"amount": 8}, key=r.key)
    assert e.value.status == 422 and e.value.kind == "mismatch"
