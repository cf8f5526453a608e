"""`strata serve`: an OpenAI-compatible HTTP server (chat and text completions, SSE streaming)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from strata.argparser import ArgumentParser
from strata.errors import StrataError
from strata.runtime.run_cli import add_engine_args, engine_options
from strata.serve.protocol import DEFAULT_MAX_BODY_BYTES


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="strata serve", description="Serve a model over OpenAI's HTTP API.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $STRATA_API_KEY, else none)")
    p.add_argument("--max-concurrent", type=int, default=8, help="requests decoded together (batch rows)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait for a slot before the server answers 429 (default 4 x max-concurrent)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are parsed (default %(default)s)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the file's name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def default_model_name(path: str) -> str:
    path = Path(path)
    return path.name if path.is_dir() else path.stem


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.max_concurrent < 1:
        raise StrataError("--max-concurrent must be at least 1")
    if args.max_queue is not None and args.max_queue < 0:
        raise StrataError("--max-queue must be >= 0")
    if args.max_body_bytes < 1:
        raise StrataError(f"--max-body-bytes must be at least 1, not {args.max_body_bytes}")
    if not 0 <= args.port < 65536:
        raise StrataError(f"--port {args.port} is not a TCP port")
    try:
        import uvicorn

        from strata.serve.app import create_app
    except ModuleNotFoundError as e:
        raise StrataError(f"serving needs {e.name}", "pip install 'strata[serve]'") from None
    from strata.tiers.expert_parallel.cli import worker_or_none

    worker = worker_or_none(args, engine_options(args))  # --expert-parallel: ranks > 0 serve their share
    if worker is not None:
        return worker
    import strata

    engine = strata.load(args.model, progress=True, **engine_options(args))
    print(engine.summary(), file=sys.stderr)
    name = args.model_name or default_model_name(args.model)
    app = create_app(engine, name, api_key=args.api_key, max_concurrent=args.max_concurrent,
                     max_waiting=args.max_queue, max_body_bytes=args.max_body_bytes)
    if not _is_loopback(args.host) and not args.api_key:
        print(f"strata serve: warning: listening on {args.host} without --api-key; anyone who can reach "
              "this port can use the model", file=sys.stderr)
    print(f"strata serve: {name} at http://{args.host}:{args.port}/v1 "
          f"({args.max_concurrent} concurrent, context {engine.ctx_size})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
