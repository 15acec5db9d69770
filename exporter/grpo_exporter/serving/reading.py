"""``/reading``: the run's reading set (the rollouts each page needs) on the metrics port, behind the same TLS and
basic auth as ``/metrics``.

The query says for which page and in which form: ``alert=GRPORewardHackSuspected`` or ``layer=2-reward`` (the
kinds that page needs; every kind without either), ``format=text`` (one rollout at a time, for a phone or a
terminal; default ``json``), ``windows=N`` (the newest N). Text is escaped in both forms (JSON in ASCII, the text
form without control characters) and served as ``text/plain`` or ``application/json`` with ``nosniff``: a
completion holding HTML or a terminal escape is shown, never run. A query naming nothing known is answered 400
with what was expected. Every other path is the app's.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence

PATH = "/reading"
MAX_QUERY_BYTES = 1024

#: query (name -> values) -> (content type, body); raises ValueError naming what was expected
Render = Callable[[Mapping[str, Sequence[str]]], tuple[str, bytes]]


class WithReading:
    """A WSGI app answering :data:`PATH` with ``render(query)``, and every other path with ``app``."""

    def __init__(self, app: Callable[..., Iterable[bytes]], render: Render) -> None:
        self.app, self.render = app, render

    def __call__(self, environ: dict[str, object], start_response: Callable[..., object]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != PATH:
            return self.app(environ, start_response)
        raw = str(environ.get("QUERY_STRING") or "")
        try:
            if len(raw) > MAX_QUERY_BYTES:
                raise ValueError(f"query: expected at most {MAX_QUERY_BYTES} bytes, got {len(raw)}")
            content_type, body = self.render(urllib.parse.parse_qs(raw, max_num_fields=8))
            status = "200 OK"
        except ValueError as exc:
            content_type, body, status = "text/plain; charset=utf-8", f"{exc}\n".encode(), "400 Bad Request"
        start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff")])
        return [body] if environ.get("REQUEST_METHOD") != "HEAD" else []


__all__ = ["PATH", "Render", "WithReading"]
