"""A Python worker runs a job through idem's job-worker protocol, to its end,
under lost replies and a killed worker: each step's effect once."""

import os
import subprocess
import sys
import threading
import time
import uuid

from conftest import Idem, LossyProxy
from idem import Client, ProblemError, Worker
import order_worker

HERE = os.path.dirname(__file__)


def wait_state(c: Client, job: str, state: str, timeout: float = 60) -> dict:
    end = time.monotonic() + timeout
    while True:
        j = c.get_job(job)
        if j["state"] == state or time.monotonic() > end:
            return j
        time.sleep(0.05)


def declare_order(c: Client) -> str:
    kind = "order-" + uuid.uuid4().hex[:8]
    c.declare_kind(kind, [{"name": "charge"}, {"name": "approve"}, {"name": "cool", "sleep": "300ms"}, {"name": "ship"}],
                   task_timeout="2s", backoff="100ms")
    return kind


def test_a_job_survives_lost_replies_and_a_killed_worker(idem, sink):
    drops = ["POST /v1/jobs", "POST /v1/work/next", "/sleep", "/await", "/done", "/signals/"]
    proxy = LossyProxy(idem.url, drops)
    try:
        c = Client(proxy.url)
        kind = declare_order(c)
        job = kind + "-1"
        c.submit_job(job, kind, params={"amount": 12})
        env = dict(os.environ, IDEM_URL=proxy.url, SINK_URL=sink.url, KIND=kind, BLOCK_IN="ship")
        first = subprocess.Popen([sys.executable, os.path.join(HERE, "order_worker.py")], env=env)
        try:
            assert wait_state(c, job, "waiting")["awaiting"] == "approved"
            c.signal_job(job, "approved", {"by": "ana"})
            assert sink.entered.wait(60), "the first worker never reached ship"
        finally:
            first.kill()
            first.wait()
        second = Worker(Client(proxy.url), [kind], order_worker.steps(sink.url, ""), wait=5)
        t = threading.Thread(target=second.run, daemon=True)
        t.start()
        j = c.wait_job(job, timeout=60)
        second.stop()
        assert j["state"] == "succeeded", j
        outs = {s["name"]: s.get("output") for s in j["steps"]}
        assert outs == {"charge": {"charge": "ch_" + job}, "approve": {"by": "ana"}, "cool": None, "ship": "shipped"}
        keys = [f"jobs:{job}.{s}" for s in ("charge", "approve", "ship")]
        assert sink.applied == {k: 1 for k in keys}
        ship = sink.calls[keys[2]]
        assert len(ship) >= 2 and ship == sorted(ship) and ship[0] < ship[-1], ship  # re-run under a greater token
        assert sorted(proxy.dropped) == sorted(drops), proxy.dropped  # every kind of reply was lost once
    finally:
        proxy.close()


def test_a_step_that_raises_is_retried_then_fails_as_declared(idem):
    c = Client(idem.url)
    kind = "pay-" + uuid.uuid4().hex[:8]
    c.declare_kind(kind, [{"name": "card", "on_error": "fail"}], task_timeout="5s")
    tries = []

    def card(s):
        tries.append(s.attempt)
        raise ValueError("card refused")

    w = Worker(c, [kind], {"card": card}, wait=5)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    c.submit_job(kind + "-1", kind)
    j = c.wait_job(kind + "-1")
    w.stop()
    assert j["state"] == "failed" and "card refused" in j["error"], j
    assert tries == [1]


def test_bad_declarations_and_unknown_kinds_are_refused(idem):
    c = Client(idem.url)
    try:
        c.declare_kind("bad", [{"name": "a", "on_error": "later"}])
        raise AssertionError("a bad declaration was taken")
    except ProblemError as e:
        assert e.status == 400 and e.kind == "invalid-request" and "later" in str(e)
    w = Worker(c, ["nobody-" + uuid.uuid4().hex[:6]], {}, wait=1)
    try:
        w.next()
        raise AssertionError("next for an undeclared kind answered")
    except ProblemError as e:
        assert e.status == 404 and e.kind == "unknown-kind"


def test_a_job_across_two_idem_processes_behind_a_balancer(idem, sink, tmp_path):
    # Two idem processes of one deployment (the second on the first's etcd),
    # every request to the next in turn: a task handed out by one is
    # reported to the other, which relays it.
    second = Idem(str(tmp_path), etcd=idem)
    proxy = LossyProxy([idem.url, second.url], ["/done", "/await"])
    try:
        c = Client(proxy.url)
        kind = declare_order(c)
        job = kind + "-1"
        c.submit_job(job, kind, params={"amount": 3})
        w = Worker(Client(proxy.url), [kind], order_worker.steps(sink.url, ""), wait=2)
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        assert wait_state(c, job, "waiting")["awaiting"] == "approved"
        c.signal_job(job, "approved", {"by": "bo"})
        j = c.wait_job(job, timeout=60)
        w.stop()
        assert j["state"] == "succeeded" and j["attempts"] == 1, j
        assert sink.applied == {f"jobs:{job}.{s}": 1 for s in ("charge", "approve", "ship")}
        assert all(len(v) == 1 for k, v in sink.calls.items() if k.endswith((".approve", ".ship"))), sink.calls
        assert sorted(proxy.dropped) == ["/await", "/done"]
    finally:
        proxy.close()
        second.stop()
