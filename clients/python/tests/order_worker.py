"""A worker process for the tests: runs the order kind's steps, and blocks
for ever in the step named by BLOCK_IN after its effect (to be killed)."""

import json
import os
import sys
import threading
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from idem import Client, Step, Worker  # noqa: E402


def effect(sink: str, s: Step, enter: bool = False) -> None:
    body = json.dumps({"key": s.step_key, "token": s.token, "job": s.job, "enter": enter}).encode()
    req = urllib.request.Request(sink, data=body, method="POST", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def steps(sink: str, block_in: str):
    def charge(s: Step):
        effect(sink, s)
        s.sleep(0.3)  # durable: the attempt ends here, and the step runs again after
        return {"charge": "ch_" + s.job}

    def approve(s: Step):
        by = s.await_event("approved", timeout=60)
        effect(sink, s)
        return by

    def ship(s: Step):
        effect(sink, s, enter=s.name == block_in)
        if s.name == block_in:
            threading.Event().wait()  # killed here
        return "shipped"

    return {"charge": charge, "approve": approve, "ship": ship}


if __name__ == "__main__":
    Worker(Client(os.environ["IDEM_URL"]), [os.environ["KIND"]], steps(os.environ["SINK_URL"], os.environ.get("BLOCK_IN", "")), wait=5).run()
