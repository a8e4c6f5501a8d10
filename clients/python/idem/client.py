"""HTTP to idem, with retries that never apply an operation twice."""

from __future__ import annotations

import base64
import json
import random
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

Json = Any

# Problem types idem answers that a retry with the same key or report can
# mend (HTTP.md, "Statuses idem answers itself").
_RETRYABLE_KINDS = {"conflict", "unavailable", "store-full", "rate-limited", "upstream-unavailable"}
_PROBLEM_PREFIX = "urn:idem:problem:"


class IdemError(Exception):
    """idem could not be reached, or answered what this client cannot read."""


class ProblemError(IdemError):
    """idem refused a call: its problem (RFC 9457) says why.

    ``kind`` is the part of the problem type after ``urn:idem:problem:``
    (``mismatch``, ``task-gone``, ...); ``status`` the HTTP status.
    """

    def __init__(self, status: int, problem: Mapping[str, Any]):
        self.status = status
        self.problem = dict(problem)
        t = str(problem.get("type", ""))
        self.kind = t[len(_PROBLEM_PREFIX):] if t.startswith(_PROBLEM_PREFIX) else t
        super().__init__(f"{status} {self.kind}: {problem.get('detail') or problem.get('title') or ''}")


@dataclass
class Response:
    """An answer to Client.call: ``replayed`` is True when idem answered
    with the response saved for the first request with this key."""

    status: int
    headers: Dict[str, str]
    body: bytes
    key: str
    replayed: bool

    def json(self) -> Json:
        return json.loads(self.body)


@dataclass
class _Answer:
    status: int
    headers: Dict[str, str]
    body: bytes


class Client:
    """A client of one idem (``base``: its URL, such as http://127.0.0.1:8080).

    ``token`` is sent as a bearer token when idem authenticates callers.
    ``timeout`` bounds each HTTP request; ``retry_for`` bounds how long a
    call keeps retrying (connection errors, lost replies, 503, 409 conflict,
    429), always with the same key or report, honouring ``Retry-After``.
    """

    def __init__(self, base: str, token: Optional[str] = None, timeout: float = 70.0, retry_for: float = 60.0):
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retry_for = retry_for

    # -- the transport ---------------------------------------------------

    def _once(self, method: str, url: str, body: Optional[bytes], headers: Mapping[str, str], timeout: float) -> _Answer:
        req = urllib.request.Request(url, data=body, method=method)
        for k, v in headers.items():
            req.add_header(k, v)
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return _Answer(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
        except urllib.error.HTTPError as e:
            return _Answer(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())

    def _send(self, method: str, url: str, body: Optional[bytes], headers: Mapping[str, str], timeout: Optional[float] = None) -> _Answer:
        """Sends a request until it gets an answer that is not worth retrying.

        Every retry is the same request: the caller makes it safe to repeat
        (an idempotency key, a job id, a report's seq).
        """
        deadline = time.monotonic() + self.retry_for
        delay = 0.05
        while True:
            try:
                a = self._once(method, url, body, headers, timeout or self.timeout)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                # The request may or may not have reached idem: the same
                # request again is recognised if it did.
                if time.monotonic() + delay > deadline:
                    raise IdemError(f"{method} {url}: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if a.status in (409, 429, 503) and _problem_kind(a) in _RETRYABLE_KINDS:
                wait = _retry_after(a, delay)
                if time.monotonic() + wait <= deadline:
                    time.sleep(wait)
                    delay = min(delay * 2, 2.0)
                    continue
            return a

    def _json(self, method: str, path: str, body: Optional[Json] = None, ok: Tuple[int, ...] = (200,), timeout: Optional[float] = None) -> Tuple[int, Json]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        a = self._send(method, self.base + path, data, headers, timeout)
        if a.status not in ok:
            raise _problem(a)
        return a.status, (json.loads(a.body) if a.body else None)

    # -- idempotent calls through the sidecar ----------------------------

    def call(self, method: str, path: str, json_body: Optional[Json] = None, body: Optional[bytes] = None,
             headers: Optional[Mapping[str, str]] = None, key: Optional[str] = None) -> Response:
        """Calls ``path`` on the service behind idem as one operation.

        The operation gets one idempotency key (``key``, or a new random one)
        and every retry sends it again: idem runs the service once and replays
        its first answer. A 422 ``mismatch`` (the key was used with other
        parameters) and a 502 ``upstream-outcome-unknown`` (the service may
        have acted) are raised, never retried with a new key.
        """
        key = key or secrets.token_urlsafe(16)
        h = dict(headers or {})
        h["Idempotency-Key"] = key
        if json_body is not None:
            body = json.dumps(json_body).encode()
            h.setdefault("Content-Type", "application/json")
        a = self._send(method, self.base + path, body, h)
        if _problem_kind(a) is not None and a.status >= 400 and a.headers.get("idempotent-replayed") != "true" \
                and _problem_kind(a) in ("mismatch", "invalid-key", "missing-key", "upstream-outcome-unknown"):
            raise _problem(a)
        return Response(a.status, a.headers, a.body, key, a.headers.get("idempotent-replayed") == "true")

    # -- jobs ------------------------------------------------------------

    def submit_job(self, id: str, kind: str, params: Optional[Json] = None, params_bytes: Optional[bytes] = None,
                   submission_id: Optional[str] = None) -> Dict[str, Any]:
        """Submits job ``id`` (its idempotency key): submitting it again is the
        same job. Retried with a submission id of its own, so that a retry
        after a lost reply is recognised as this submission."""
        req: Dict[str, Any] = {"id": id, "kind": kind, "submission_id": submission_id or secrets.token_urlsafe(16)}
        if params is not None:
            req["params"] = params
        if params_bytes is not None:
            req["params_base64"] = base64.b64encode(params_bytes).decode()
        _, j = self._json("POST", "/v1/jobs", req, ok=(200, 201))
        return j

    def get_job(self, id: str) -> Dict[str, Any]:
        _, j = self._json("GET", "/v1/jobs/" + urllib.parse.quote(id, safe=""))
        return j

    def signal_job(self, id: str, event: str, payload: Optional[Json] = None) -> None:
        """Delivers ``event`` to job ``id`` once, however often it is sent."""
        body = {} if payload is None else {"payload": payload}
        self._json("POST", f"/v1/jobs/{urllib.parse.quote(id, safe='')}/signals/{urllib.parse.quote(event, safe='')}", body, ok=(202,))

    def wait_job(self, id: str, timeout: float = 60.0, poll: float = 0.1) -> Dict[str, Any]:
        """Reads job ``id`` until it has ended (or is parked), for at most
        ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            j = self.get_job(id)
            if j["state"] in ("succeeded", "failed", "cancelled", "parked") or time.monotonic() > end:
                return j
            time.sleep(poll)

    def declare_kind(self, name: str, steps: List[Mapping[str, Any]], **policy: Any) -> Dict[str, Any]:
        """Declares kind ``name``: its steps (``{"name": ...}``, with ``sleep``
        or ``await`` for the ones idem runs itself) and its policy
        (``max_attempts``, ``backoff``, ``max_backoff``, ``deadline``,
        ``task_timeout``, as Go duration strings)."""
        body = {"name": name, "steps": list(steps), **policy}
        _, d = self._json("PUT", "/v1/kinds/" + urllib.parse.quote(name, safe=""), body)
        return d


def _problem_kind(a: _Answer) -> Optional[str]:
    if not a.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    try:
        t = json.loads(a.body).get("type", "")
    except (ValueError, AttributeError):
        return None
    return t[len(_PROBLEM_PREFIX):] if t.startswith(_PROBLEM_PREFIX) else t


def _problem(a: _Answer) -> ProblemError:
    try:
        p = json.loads(a.body)
        if not isinstance(p, dict):
            raise ValueError
    except ValueError:
        p = {"type": "", "detail": a.body[:200].decode("utf-8", "replace")}
    return ProblemError(a.status, p)


def _retry_after(a: _Answer, fallback: float) -> float:
    try:
        return max(float(a.headers.get("retry-after", "")), 0.0)
    except ValueError:
        return fallback * (1 + random.random() / 5)
