"""Review 10: the client's report numbering against idem's.

Promise (clients/python/idem/worker.py, Step._report: "A report is numbered
once idem answered it"; the commit of 1e95df0 and jobs/hub.go checkReport:
a sleep past half the retention, or an await of no valid event name, "is
refused and changes nothing"). idem does not number a refused report (the
task's last seq stays), but the client takes its number: the step's next
report skips one and idem refuses it as well ("seq 2 follows 0"). A step
that handles the refusal (falls back) can then never report done: its
attempt ends as a dead worker's, again and again.
"""

import threading
import uuid

from idem import Client, ProblemError, Worker


def test_a_step_that_handles_a_refused_sleep_still_finishes(idem):
    c = Client(idem.url)
    kind = "fallback-" + uuid.uuid4().hex[:8]
    c.declare_kind(kind, [{"name": "a"}], task_timeout="2s", backoff="100ms")
    refused = []

    def a(s):
        try:
            s.sleep(10 ** 7)  # ~115 days: past half the retention, refused
        except ProblemError as e:
            refused.append(e.status)
        return "fell back"

    w = Worker(c, [kind], {"a": a}, wait=2)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        c.submit_job(kind + "-1", kind)
        j = c.wait_job(kind + "-1", timeout=15)
    finally:
        w.stop()
    assert refused and refused[0] == 400, refused
    assert j["state"] == "succeeded", (j, "the done after a refused sleep was refused too: the client numbered the refused report")
