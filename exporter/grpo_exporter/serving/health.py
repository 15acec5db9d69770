"""``/healthz``: is the exporter alive, and how old is the run's last step, without rendering the exposition.

A probe (a Kubernetes liveness or startup probe, a SLURM health check, a person with curl) needs an answer in
microseconds, not the whole scrape: this reads three values of the published snapshot. It always answers 200
while the process serves (the process is alive: whether training is stalled is the step age's question, and the
rules' GRPOTrainingStalled judges it against the run's own cadence); the body is JSON::

    {"status": "ok", "run": "exp-42", "last_step": 1200, "last_step_age_seconds": 4.2, "finished": false}

``last_step`` and ``last_step_age_seconds`` are null before the first step. Every other path is the metrics
app's. Behind basic auth where it is configured, like every path (a probe sends the header).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grpo_exporter import catalog

PATH = "/healthz"
_STEP = catalog.key("grpo_last_step")
_STEP_TIME = catalog.key("grpo_last_step_timestamp_seconds")
_FINISHED = catalog.key("grpo_run_finished")


def health(run: str, snapshot: Mapping[str, float], now: float | None = None) -> dict[str, Any]:
    """The ``/healthz`` document of run ``run`` from a published ``snapshot``."""
    now = time.time() if now is None else now
    stamp = snapshot.get(_STEP_TIME)
    step = snapshot.get(_STEP)
    return {
        "status": "ok",
        "run": run,
        "last_step": None if step is None or stamp is None else int(step),
        "last_step_age_seconds": None if stamp is None else round(max(0.0, now - stamp), 3),
        "finished": snapshot.get(_FINISHED, 0.0) == 1.0,
    }


class WithHealth:
    """A WSGI app answering :data:`PATH` with ``document()`` as JSON, and every other path with ``app``."""

    def __init__(self, app: Callable[..., Iterable[bytes]], document: Callable[[], dict[str, Any]]) -> None:
        self.app, self.document = app, document

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != PATH:
            return self.app(environ, start_response)
        body = json.dumps(self.document()).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-store")])
        return [body] if environ.get("REQUEST_METHOD") != "HEAD" else []


__all__ = ["PATH", "WithHealth", "health"]
