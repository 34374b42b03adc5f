"""A decode member that is broken on purpose, for fault (j): ``python -m tests.fleet.faulty_member --host A
--port P --fault garbage|truncated``.

It is a real HTTP server that passes what the proxy checks before it routes to a member (``/health``, and
the one-token batch probe per output mode the decode pool's admission sends), then fails every streamed
generate request: ``garbage`` answers 200 and an event that is not JSON, ``truncated`` answers 200 and
closes the connection in the middle of the body. What a member with a bad NIC, a proxy in between that
mangles bodies, or a server crashing while it writes looks like from the proxy's side.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    fault = "garbage"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(200, b"{}" if self.path != "/health" else b"")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        if not body.get("stream"):  # the admission probe: a proper one-token answer in the mode asked
            mode = body.get("output_mode", "tokens")
            choice = {"index": 0, "finish_reason": "length", "token_ids": [0], "text": "", "message": {"role": "assistant"}}
            self._answer(200, json.dumps({"request_id": "probe", "output_mode": mode, "choices": [choice]}).encode())
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        if self.fault == "garbage":
            payload = b"data: {this is not json\n\n"
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_header("content-length", "100000")  # promised, never sent: the body breaks off
        self.end_headers()
        self.wfile.write(b"data: ")
        self.wfile.flush()
        self.close_connection = True

    def _answer(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fault", choices=["garbage", "truncated"], required=True)
    args = parser.parse_args()
    _Handler.fault = args.fault
    ThreadingHTTPServer((args.host, args.port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
