"""Where ``grpo-exporter read`` finds a reading set: the serving exporter (the URL a page links), a reading file the
reading set wrote in the recorder directory (``reading-<run>-r<rank>.json``: it outlives the process), an incident
directory (``reading.json`` beside the incident), or the recorder directory itself (its newest reading file, else
the latest incident's). Read without torch."""

from __future__ import annotations

import base64
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from grpo_exporter.recorder.reading_doc import FORMAT
from grpo_exporter.recorder.store import incidents

# a reading set's bound: 10 windows x 6 kinds x 16 rows x (2,000 + 4,000 characters, up to 12 bytes each escaped)
MAX_BYTES = 80 << 20
TIMEOUT_S = 10.0
PASSWORD_VARIABLE = "GRPO_READ_PASSWORD"  # basic auth's password: never on the command line
INCIDENT_FILE = "reading.json"


class ReadingSourceError(RuntimeError):
    """A source that holds no reading set, said with what was expected."""


def _checked(document: Any, where: str) -> dict[str, Any]:
    if not isinstance(document, dict) or document.get("format") != FORMAT or "windows" not in document:
        raise ReadingSourceError(f"{where}: expected a reading set (format {FORMAT}), got another document")
    return document


def from_url(url: str, user: str | None = None, ca_file: Path | None = None) -> dict[str, Any]:
    """The reading set served at ``url`` (its ``/reading``, whatever path was given: a page's link, the metrics URL,
    or the exporter's address), as JSON; basic auth as ``user`` with the password from :data:`PASSWORD_VARIABLE`."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in ("format", "alert", "layer")]
    target = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/reading",
                                      urllib.parse.urlencode([*query, ("format", "json")]), ""))
    request = urllib.request.Request(target)
    if user is not None:
        password = os.environ.get(PASSWORD_VARIABLE, "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else None
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as answer:
            body = answer.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(2000).decode("utf-8", "replace").strip()
        raise ReadingSourceError(f"{target}: the exporter answered {exc.code} {exc.reason}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ReadingSourceError(f"{target}: expected a serving exporter, got {exc}") from exc
    if len(body) > MAX_BYTES:
        raise ReadingSourceError(f"{target}: expected at most {MAX_BYTES} bytes, got more")
    try:
        return _checked(json.loads(body), target)
    except ValueError as exc:
        raise ReadingSourceError(f"{target}: expected a reading set (JSON), got {exc}") from exc


def from_path(path: Path) -> dict[str, Any]:
    """The reading set in a file, an incident directory, or a recorder directory (its newest reading file, else
    the latest incident's)."""
    if path.is_dir():
        files = sorted(path.glob("reading-*.json"), key=lambda p: p.stat().st_mtime)
        if (path / INCIDENT_FILE).is_file():
            path = path / INCIDENT_FILE
        elif files:
            path = files[-1]
        else:
            latest = [p / INCIDENT_FILE for p in incidents(path) if (p / INCIDENT_FILE).is_file()]
            if not latest:
                raise ReadingSourceError(f"{path}: expected a recorder directory with a reading set (reading-*.json, "
                                         f"or an incident holding {INCIDENT_FILE}), found none")
            path = latest[-1]
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ReadingSourceError(f"{path}: expected at most {MAX_BYTES} bytes, got {path.stat().st_size}")
        return _checked(json.loads(path.read_bytes()), str(path))
    except (OSError, ValueError) as exc:
        raise ReadingSourceError(f"{path}: expected a readable reading set (JSON), got {exc}") from exc


def load(source: str, user: str | None = None, ca_file: Path | None = None) -> dict[str, Any]:
    """The reading set of ``source``: an http(s) URL, else a path."""
    if source.startswith(("http://", "https://")):
        return from_url(source, user, ca_file)
    return from_path(Path(source).expanduser())


def page_of(source: str) -> tuple[str | None, str | None]:
    """The alert and layer a page's link names (None where it names none, or is no URL)."""
    if not source.startswith(("http://", "https://")):
        return None, None
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(source).query))
    return query.get("alert"), query.get("layer")


__all__ = ["PASSWORD_VARIABLE", "ReadingSourceError", "load", "page_of"]
