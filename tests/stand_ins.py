"""Local stand-ins of the services Alertmanager pages through, on 127.0.0.1 with free ports: an HTTP API that
records every request (Slack's incoming webhook, PagerDuty's Events v2, Opsgenie's alert API all answer it) and an
SMTP server that records every message (with the credentials it was given)."""

from __future__ import annotations

import base64
import email
import email.policy
import json
import socketserver
import threading
from dataclasses import dataclass
from email.message import EmailMessage
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: Any


class HTTPStandIn:
    """Answers every POST 200 (202 under /v2/, as PagerDuty and Opsgenie do) and records it, JSON decoded."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with stand_in.lock:
                    stand_in.requests.append(Request(self.path, dict(self.headers.items()), json.loads(raw or b"{}")))
                accepted = "/v2/" in self.path
                answer = json.dumps({"status": "success", "message": "Event processed", "result": "ok",
                                     "requestId": "r1"} if accepted else {}).encode()
                self.send_response(202 if accepted else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def under(self, prefix: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.path.startswith(prefix)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class Mail:
    sender: str
    recipients: list[str]
    credentials: str  # "user\0password" as AUTH PLAIN carried it, "" without authentication
    message: EmailMessage


class SMTPStandIn:
    """An SMTP server (EHLO, AUTH PLAIN, MAIL, RCPT, DATA) that keeps every message; no TLS offered."""

    def __init__(self) -> None:
        self.mails: list[Mail] = []
        self.lock = threading.Lock()
        stand_in = self

        class Handler(socketserver.StreamRequestHandler):
            def reply(self, line: str) -> None:
                self.wfile.write(line.encode() + b"\r\n")

            def data(self) -> bytes:
                lines = []
                while (line := self.rfile.readline()) not in (b".\r\n", b""):
                    lines.append(line[1:] if line.startswith(b"..") else line)
                return b"".join(lines)

            def handle(self) -> None:
                sender, recipients, credentials = "", [], ""
                self.reply("220 127.0.0.1 stand-in ESMTP")
                while line := self.rfile.readline().decode().rstrip("\r\n"):
                    verb, _, rest = line.partition(" ")
                    verb = verb.upper()
                    if verb in ("EHLO", "HELO"):
                        self.reply("250-127.0.0.1")
                        self.reply("250 AUTH PLAIN")
                    elif verb == "AUTH":
                        credentials = base64.b64decode(rest.split(" ", 1)[1]).decode().lstrip("\0")
                        self.reply("235 2.7.0 Authentication successful")
                    elif verb == "MAIL":
                        sender = rest.split(":", 1)[1].split()[0].strip("<>")
                        self.reply("250 OK")
                    elif verb == "RCPT":
                        recipients.append(rest.split(":", 1)[1].strip().strip("<>"))
                        self.reply("250 OK")
                    elif verb == "DATA":
                        self.reply("354 End data with <CR><LF>.<CR><LF>")
                        data = self.data()
                        message = email.message_from_bytes(data, policy=email.policy.default)
                        with stand_in.lock:
                            stand_in.mails.append(Mail(sender, recipients, credentials, message))  # type: ignore[arg-type]
                        self.reply("250 OK queued")
                    elif verb == "QUIT":
                        self.reply("221 Bye")
                        return
                    else:
                        self.reply("250 OK")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.smarthost = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self) -> list[Mail]:
        with self.lock:
            return list(self.mails)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
