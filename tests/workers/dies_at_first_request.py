"""A stand-in for a vLLM server whose engine cannot run its model: it passes readiness (the run's id and, with a key,
the proof of it: primerl.transport.identity) and dies at its first generate request, logging the engine's error
first, then a leak report, and exiting 0, as vLLM-CPU does with an unsupported head size. With `--serve-first` it
answers that request (logging uvicorn's access line, which tells that it served) and dies at the second. With
`--killed-at-start MARKER` it kills itself with SIGKILL before it answers anything, the first time (when MARKER does
not exist yet: it creates it), as the OOM killer or an operator may kill a starting server; with `--fails-at-start`
it exits 1 before it answers anything, as an engine that refuses its config does; with `--exits-after-start` it logs
uvicorn's "Application startup complete" and exits 0 before it answers anything, as a server whose engine died right
after it came up does (a worker killed in its first weight load); with `--hangs-at-request MARKER`, the first time,
that request neither dies nor answers: it logs the engine's death, closes the listening port and waits, as vLLM does
when its engine core dies under a `/collective_rpc` load (uvicorn's graceful shutdown waits for that request
forever).

    python -m tests.workers.dies_at_first_request --port P [--serve-first] [--killed-at-start MARKER]
        [--fails-at-start] [--exits-after-start] [--hangs-at-request MARKER]   (key and id from the environment)
"""

import argparse
import http.server
import os
import signal
import sys
import time
from pathlib import Path

from primerl.inference.guard import API_KEY_ENV
from primerl.transport.identity import (
    CHALLENGE_HEADER,
    PROOF_HEADER,
    SERVER_ID_ENV,
    SERVER_ID_HEADER,
    key_digest,
    proof,
)

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ENGINE_ERROR = "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--serve-first", action="store_true")
    parser.add_argument("--killed-at-start", type=Path)
    parser.add_argument("--fails-at-start", action="store_true")
    parser.add_argument("--exits-after-start", action="store_true")
    parser.add_argument("--hangs-at-request", type=Path)
    args, _ = parser.parse_known_args()
    time.sleep(0.5)  # starting
    if args.fails_at_start:
        print("ValueError: the engine refuses this config", flush=True)
        sys.exit(1)
    if args.exits_after_start:
        print("INFO:     Application startup complete.", flush=True)
        print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", flush=True)
        sys.exit(0)
    if args.killed_at_start and not args.killed_at_start.exists():
        args.killed_at_start.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    key, served = os.environ.get(API_KEY_ENV), [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header(SERVER_ID_HEADER, os.environ.get(SERVER_ID_ENV, ""))
            nonce = self.headers.get(CHALLENGE_HEADER)
            if nonce and key:
                self.send_header(PROOF_HEADER, proof(key_digest(key), nonce, args.port))
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer(b"")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if args.serve_first and not served[0]:
                served[0] += 1
                self.answer(b"{}")
                print(f'INFO:     127.0.0.1:1 - "POST {self.path} HTTP/1.1" 200 OK', flush=True)
                return
            if args.hangs_at_request and not args.hangs_at_request.exists():
                args.hangs_at_request.touch()
                print(f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD}", flush=True)
                print("INFO:     Waiting for connections to close. (CTRL+C to force quit)", flush=True)
                self.server.socket.close()  # new connections are refused; this one waits
                time.sleep(3600)
            print("(EngineCore pid=1) ERROR EngineCore encountered a fatal error.", flush=True)
            print("Traceback (most recent call last):", flush=True)
            print(ENGINE_ERROR, flush=True)
            print("nanobind: leaked 4 instances!", flush=True)
            print(' - leaked instance 0x7f of type "triton._C.libtriton.ir.attribute"', flush=True)
            sys.stdout.flush()
            os._exit(0)

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
