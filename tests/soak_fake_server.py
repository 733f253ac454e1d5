"""A stand-in for `veloxpatch serve` in tests/test_bench_soak.py: /health with
a `veloxpatch` object, and streamed chat answers that depend only on the body
(a 400 for a body that is not JSON or has a bad field)."""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        report = {"reserved_bytes": 1000, "prompt_cache_bytes": 2000}
        self.answer(200, {"status": "ok", "veloxpatch": report})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            body = json.loads(raw)
            ok = bool(body["messages"]) and body.get("max_tokens", 1) >= 1
            ok = ok and isinstance(body.get("temperature", 0), (int, float))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return self.answer(400, {"error": "bad request"})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        words = ["answer", str(len(raw)), "done"]
        try:
            for w in words:
                chunk = {"choices": [{"delta": {"content": w + " "}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass  # the client closed the socket (a disconnect)


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
