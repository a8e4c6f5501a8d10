"""idem's client for Python, on the standard library alone.

- :class:`Client` makes idempotent calls through idem's sidecar (one key per
  operation, retried with the same key), and submits, reads and signals jobs.
- :class:`Worker` runs the steps of kinds declared once (``Client.declare_kind``)
  through idem's job-worker protocol: idem claims each job, counts its attempts,
  saves each step's output as a recovery point and applies the kind's retries;
  the worker runs the step's code.
"""

from .client import Client, Response, IdemError, ProblemError
from .worker import Worker, Step, StepFailed, TaskGone

__all__ = ["Client", "Response", "IdemError", "ProblemError", "Worker", "Step", "StepFailed", "TaskGone"]
