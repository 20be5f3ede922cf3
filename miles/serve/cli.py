"""`miles serve --model PATH`: the rollout engine behind an OpenAI-compatible HTTP API (miles/serve/).

Binds 127.0.0.1 unless `--host` says otherwise. With `--api-key-env NAME`, the key is read from that
environment variable (never from the command line, which other users can see) and every request must send
`Authorization: Bearer <key>`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os

from miles.config import DataConfig, RolloutConfig
from miles.errors import MilesUserError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles serve", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint folder, builtin:NAME or init:ARCH:PRESET")
    parser.add_argument(
        "--served-model-name", default=None, help="the `model` clients send (default: --model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key-env", default=None, help="environment variable holding the API key")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-running-requests", type=int, default=RolloutConfig.max_running_requests)
    parser.add_argument("--kv-cache-fraction", type=float, default=RolloutConfig.kv_cache_fraction)
    parser.add_argument("--system-prompt", default=None, help="prepended to chat requests without one")
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=3600.0,
        help="a request waiting longer: 504 (> 0; inf: no limit)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=["qwen3", "deepseek_r1"],
        default=None,
        help="return a chat reply's <think> block as reasoning_content (default: left in the content)",
    )
    parser.add_argument(
        "--max-samples-per-request",
        type=int,
        default=None,
        help="a request asking for more samples (prompts x n) gets a 400 (default 1024)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="connections open at once; past it a new one gets a 503 (default 256)",
    )
    args = parser.parse_args(argv)
    # Unset: the server's defaults (app.py, not imported before the model loads: torch is slow).
    given = {"max_samples_per_request": args.max_samples_per_request, "max_connections": args.max_connections}
    limits = {name: value for name, value in given.items() if value is not None}
    for name, value in limits.items():
        if value < 1:
            raise MilesUserError(f"--{name.replace('_', '-')} {value}: give an integer >= 1")
    if not 0 < args.request_timeout_s <= math.inf:  # NaN fails too; checked before the model loads
        raise MilesUserError(
            f"--request-timeout-s {args.request_timeout_s}: give a number of seconds > 0 (inf: no limit)"
        )

    from miles.build import set_cpu_threads
    from miles.data import PromptFormatter
    from miles.model_io import load_model
    from miles.redaction import redact_logs
    from miles.rollout import Engine
    from miles.serve.app import EngineServer

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise MilesUserError(
                f"--api-key-env {args.api_key_env}: that environment variable is empty or unset"
            )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_logs()  # an error that quotes the key, or another secret of the environment, is masked
    set_cpu_threads(1)
    loaded = load_model(args.model, args.dtype, args.device)
    cfg = RolloutConfig(
        max_running_requests=args.max_running_requests, kv_cache_fraction=args.kv_cache_fraction
    )
    engine = Engine(loaded.model, loaded.tokenizer, cfg)
    formatter = PromptFormatter(loaded.tokenizer, DataConfig(system_prompt=args.system_prompt))
    try:
        server = EngineServer(
            engine,
            formatter,
            args.served_model_name or args.model,
            args.host,
            args.port,
            api_key,
            args.request_timeout_s,
            args.reasoning_parser,
            **limits,
        )
    except OSError as err:
        raise MilesUserError(f"cannot listen on {args.host}:{args.port} ({err}); {listen_hint(err)}") from err
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("miles.serve").warning(
            "listening on %s without an API key: anyone who can reach it can use the model (--api-key-env)",
            args.host,
        )
    logging.getLogger("miles.serve").info(
        "serving %s at %s (OpenAI API: /v1/completions, /v1/chat/completions)", server.model_name, server.url
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def listen_hint(err: OSError) -> str:
    """What to change when the socket cannot be bound: the port where it is taken or privileged, else the
    host (a name that does not resolve, an address this machine does not have)."""
    if err.errno in (errno.EADDRINUSE, errno.EACCES):
        return "pick another --port"
    return "check --host: an address of this machine (127.0.0.1, ::1, 0.0.0.0, ::) or a name resolving to one"
