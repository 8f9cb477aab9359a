"""`make demo PROMPT="..."`: start a server, stream one chat answer to the terminal, stop the server."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from client import Client
from pagedserve.free_port import free_port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.demo")
    parser.add_argument("prompt")
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    port = free_port()
    command = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", str(port), "--no-http"]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=600)
            print(f"> {args.prompt}", flush=True)
            for chunk in client.generate_stream(messages=[{"role": "user", "content": args.prompt}],
                                                max_tokens=args.max_tokens, temperature=0.0):
                print(chunk.text, end="", flush=True)
            print(flush=True)
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
