"""A worker for declared kinds, on idem's job-worker protocol (/v1/work)."""

from __future__ import annotations

import base64
import datetime
import logging
import threading
import traceback
import urllib.parse
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from .client import Client, IdemError, ProblemError

log = logging.getLogger("idem.worker")


class TaskGone(Exception):
    """The step's attempt ended under it (the job waits, the worker was
    silent past its timeout, idem restarted): stop; the job resumes from its
    last recovery point."""


class StepFailed(Exception):
    """A sleep or await idem refused (a duration past the retention, waits in
    another order than the step's first run): the step stops."""


class _Suspended(BaseException):
    # A BaseException: a step's own `except Exception` must not catch it.
    pass


class Step:
    """What a step's function sees of its job.

    ``params`` and ``outputs`` (the finished steps' outputs, by name) are
    decoded JSON (bytes for what is not JSON). Send ``step_key`` downstream
    as the effect's idempotency key (the same on every attempt) and
    ``token`` as its fencing token (greater on every takeover).
    """

    def __init__(self, worker: "Worker", task: Mapping[str, Any]):
        self._w = worker
        self._task = task
        self._seq = 0
        self._lock = threading.Lock()
        self.id: str = task["task"]
        self.job: str = task["job"]
        self.kind: str = task["kind"]
        self.name: str = task["step"]
        self.attempt: int = task["attempt"]
        self.token: int = int(task["token"])
        self.step_key: str = task["step_key"]
        self.compensating: bool = bool(task.get("compensating"))
        self.timeout: float = task["timeout_ms"] / 1000.0
        self.params: Any = task.get("params")
        if "params_base64" in task:
            self.params = base64.b64decode(task["params_base64"])
        self.outputs: Dict[str, Any] = dict(task.get("outputs") or {})
        for k, v in (task.get("outputs_base64") or {}).items():
            self.outputs[k] = base64.b64decode(v)

    def _report(self, op: str, body: Dict[str, Any]) -> Dict[str, Any]:
        # A report is numbered once idem took it: one idem refused (400:
        # nothing changed) or whose outcome is unknown (idem not reached
        # within the retries) leaves its number to the next report, which
        # idem answers as the first if that one landed.
        with self._lock:
            seq = self._seq + 1
        if op != "renew":
            body = dict(body, seq=seq)
        try:
            _, a = self._w.client._json("POST", f"/v1/work/tasks/{urllib.parse.quote(self.id, safe='')}/{op}", body)
        except ProblemError as e:
            # Refused (a 400 changes nothing, and takes no number), or gone.
            if e.kind == "task-gone":
                raise TaskGone(str(e)) from None
            raise
        if op != "renew":
            with self._lock:
                self._seq = max(self._seq, seq)
        return a

    def sleep(self, seconds: float = 0.0, until: Optional[datetime.datetime] = None) -> None:
        """Sleeps durably: the first time a run of the step gets here, idem
        saves the wake-up time with the job and ends the attempt (this call
        does not return); from that time on, a worker runs the step again
        from its start, and this call returns at once. Code before it runs
        again: keep what must happen once in an earlier step."""
        if until is not None and seconds:
            raise ValueError("sleep: give seconds or until, not both")
        # A naive until is local time, as datetime.astimezone takes it.
        body: Dict[str, Any] = {"duration_ms": int(seconds * 1000)} if until is None else \
            {"until": until.astimezone(datetime.timezone.utc).isoformat()}
        if until is None and body["duration_ms"] == 0:
            body["duration_ms"] = 1
        a = self._report("sleep", body)
        if a["result"] == "suspended":
            raise _Suspended()
        if a["result"] == "failed":
            raise StepFailed(a.get("error", ""))

    def await_event(self, event: str, timeout: float = 0.0) -> Any:
        """Waits durably for ``event`` of this job (Client.signal_job), for at
        most ``timeout`` seconds (0: as long as the job is kept), and returns
        its payload; raises TimeoutError if it did not come in time. As with
        sleep, the step runs again from its start once it comes."""
        body: Dict[str, Any] = {"event": event}
        if timeout:
            body["timeout_ms"] = int(timeout * 1000)
        a = self._report("await", body)
        r = a["result"]
        if r == "suspended":
            raise _Suspended()
        if r == "timeout":
            raise TimeoutError(f"event {event} did not come in time")
        if r == "failed":
            raise StepFailed(a.get("error", ""))
        if "payload_base64" in a:
            return base64.b64decode(a["payload_base64"])
        return a.get("payload")


StepFunc = Callable[[Step], Any]


class Worker:
    """Runs the steps of ``kinds`` with ``steps`` (a function per step name).

    A step function returns its output (anything JSON encodes, or bytes,
    or None); idem saves it as the step's recovery point, and a step that
    finished never runs again for its job. An exception fails the step: the
    kind's ``on_error`` decides (retry after its backoff, fail, compensate).
    ``undo`` holds the compensations of steps declared with ``compensate``.
    Run ``run()`` in as many threads or processes as you like.
    """

    def __init__(self, client: Client, kinds: Sequence[str], steps: Mapping[str, StepFunc],
                 undo: Optional[Mapping[str, StepFunc]] = None, wait: float = 30.0):
        self.client = client
        self.kinds = list(kinds)
        self.steps = dict(steps)
        self.undo = dict(undo or {})
        self.wait = wait
        self._stop = threading.Event()

    def stop(self) -> None:
        """Makes run() return once its current step ends."""
        self._stop.set()

    def next(self) -> Optional[Step]:
        """Waits for a step to run (None if none came within the wait)."""
        _, t = self.client._json("POST", "/v1/work/next", {"kinds": self.kinds, "wait_ms": int(self.wait * 1000)},
                                 ok=(200, 204), timeout=self.wait + 30)
        return None if t is None else Step(self, t)

    def run(self) -> None:
        """Runs steps until stop() is called."""
        while not self._stop.is_set():
            try:
                s = self.next()
            except IdemError as e:
                log.warning("idem: asking for work failed: %s", e)
                self._stop.wait(1.0)
                continue
            if s is not None:
                self.run_step(s)

    def run_step(self, s: Step) -> None:
        """Runs one step and reports how it ended."""
        fn = (self.undo if s.compensating else self.steps).get(s.name)
        stop_renewing = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(s, stop_renewing), daemon=True)
        renewer.start()
        try:
            if fn is None:
                raise RuntimeError(f"this worker has no function for step {s.name} of kind {s.kind}")
            out = fn(s)
        except _Suspended:
            return  # the job waits; idem ended the attempt
        except TaskGone as e:
            log.info("idem: step %s of job %s ended under its worker: %s", s.name, s.job, e)
            return
        except Exception as e:  # noqa: BLE001: a step's failure is the kind's to handle
            self._end(s, "fail", {"error": f"{type(e).__name__}: {e}"[:4000] or type(e).__name__})
            log.debug("idem: step failed: %s", traceback.format_exc())
            return
        finally:
            stop_renewing.set()
        body: Dict[str, Any] = {}
        if isinstance(out, (bytes, bytearray)):
            body["output_base64"] = base64.b64encode(out).decode()
        elif out is not None:
            body["output"] = out
        self._end(s, "done", body)

    def _end(self, s: Step, op: str, body: Dict[str, Any]) -> None:
        try:
            s._report(op, body)
        except TaskGone as e:
            log.info("idem: step %s of job %s ended before its report: %s", s.name, s.job, e)
        except IdemError as e:
            # Not known to have landed: the task times out, and the step
            # runs again elsewhere (its effects keyed by step_key).
            log.warning("idem: reporting step %s of job %s failed: %s", s.name, s.job, e)

    def _renew(self, s: Step, stop: threading.Event) -> None:
        while not stop.wait(max(s.timeout / 3, 0.2)):
            try:
                s._report("renew", {})
            except (TaskGone, IdemError):
                return
