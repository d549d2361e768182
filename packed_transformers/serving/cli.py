"""Serve a fine-tuned folder over HTTP, packing requests as they arrive.

    python -m packed_transformers.serving --model runs/bbc_packed/model [--host 127.0.0.1 --port 8080]
        [--policy packed | fifo-tokens | padded] [--max-batch-tokens 16384] [--max-wait-ms 0]
        [--dtype float32 | bfloat16 | int8] [--device cpu | cuda] [--runtime torch | openvino | onnxruntime | auto]

(`python -m packed_transformers.finetune.serve` is an alias of this command.)

Classification folders answer text-embeddings-inference's `POST /predict` (its clients work
unchanged; multi-label scores are sigmoids, where TEI applies softmax); question-answering
folders answer `POST /qa`, token-classification folders `POST /tokens`; any folder
transformers' save_pretrained wrote is taken as it is (door/folder.py). Also /health, /ready, /metrics (Prometheus), /info. The
policies (serving/policies.py): `packed` packs what is waiting into rows of a few fixed
widths, longest first, the starving first; `fifo-tokens` is TEI's (first come, first
served up to the token budget, padded to the longest); `padded` is a fixed batch padded
to the length the model was fine-tuned at. Overload is refused with 429 (a bounded queue), never queued
without bound; SIGTERM answers what was admitted, then exits 0. `--api-key` (or $API_KEY) requires
TEI's `Authorization: Bearer` header; Host and Origin are checked against the bind address
and localhost (serving/access.py). The pieces live in serving/.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from packed_transformers.common.choices import ATTENTION_BACKENDS, INFERENCE_ATTENTION_BACKEND, RUNTIMES
from packed_transformers.common.cli import add_inference_options, below_one, command_parser, refuse
from packed_transformers.serving.policies import POLICIES


def default_sequences_per_pack(task: str) -> int:
    """K when --max-sequences-per-pack is not given: 16 for embeddings (short texts: at
    saturation K = 6 left BBC texts' rows 73% real tokens, K = 16 96%, 1.37x the real
    tokens/s; bench/profile_policies.py, docs/embeddings.md), as commands.embed's; 6 else."""
    return 16 if task == "embedding" else 6


def serve_parser() -> argparse.ArgumentParser:
    """`packed serve`'s options."""
    parser = command_parser("python -m packed_transformers.serving", __doc__)
    add_inference_options(parser, "finetune.train output model folder, or a sentence-transformers folder")
    parser.add_argument(
        "--pooling", nargs="+", help="embedding: pool a plain BERT folder this way (mean, cls, max, ...)"
    )
    parser.add_argument(
        "--runtime",
        default="torch",
        choices=RUNTIMES,
        help="openvino: classification and embedding folders' packed rows through OpenVINO, float32, a "
        "graph compiled per row shape at its first batch; onnxruntime: through ONNX Runtime, float32 or "
        "int8, one graph for every batch shape; auto: the runtime measured faster for serving (torch: "
        "OpenVINO served at 0.73x its rate, docs/embeddings.md)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--policy", default="packed", choices=POLICIES)
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        help=f"BERT's block-diagonal kernel (default {INFERENCE_ATTENTION_BACKEND}: measured fastest on the CPU; "
        "every backend computes the same outputs)",
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="tokens per forward (TEI's default)"
    )
    parser.add_argument(
        "--max-wait-ms", type=float, default=0.0, help="packed: how long a batch may fill before it runs"
    )
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[64, 128, 256, 512], help="packed row widths"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="padded: rows per forward")
    parser.add_argument("--max-queue", type=int, default=1024, help="sequences waiting at most (429 beyond)")
    parser.add_argument(
        "--timeout-s", type=float, default=30.0, help="per request, from admission (504 after)"
    )
    parser.add_argument(
        "--max-client-batch-size", type=int, default=32, help="inputs per request (413 beyond)"
    )
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body size (413 beyond)")
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=10.0,
        help="seconds a request body may take to arrive (408 after)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        help="a request's head: line and headers (431 beyond)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="seconds a request's head may take to arrive, from its first byte (408 after)",
    )
    parser.add_argument("--tokenizer-threads", type=int, default=1)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /ready (default: $API_KEY)",
    )
    parser.add_argument(
        "--allowed-hosts",
        nargs="+",
        help="Host / Origin names served (default: the bind address and localhost; any for 0.0.0.0)",
    )
    parser.set_defaults(max_sequences_per_pack=None)
    return parser


def argument_mistake(args) -> str | None:
    """The one line for an option out of its range, or None: decided before anything loads."""
    wrong = below_one(args, ("port", "max_batch_tokens", "max_sequences_per_pack", "batch_size", "max_queue",
                             "max_client_batch_size", "max_body_bytes", "max_header_bytes",
                             "tokenizer_threads"))  # fmt: skip
    if wrong:
        return wrong
    if args.timeout_s <= 0 or args.body_timeout_s <= 0 or args.header_timeout_s <= 0 or args.max_wait_ms < 0:
        return "--timeout-s, --body-timeout-s and --header-timeout-s must be > 0, --max-wait-ms >= 0"
    from packed_transformers.inference.runtime_choice import arguments_refusal

    return arguments_refusal(args, serving=True)  # the CPU's flags against --dtype: before torch


def runtime_mistake(args, argv) -> str | None:
    """The one line for a runtime, device or dtype this folder cannot be served with, or None.
    An exported folder's graph decides them: torch is then never imported."""
    from packed_transformers.door.exported_folder import is_exported, settle_exported_arguments
    from packed_transformers.inference.runner import runtime_problem
    from packed_transformers.model.hf_checkpoint import quiet_transformers

    if is_exported(args.model):
        wrong = settle_exported_arguments(args, sys.argv[1:] if argv is None else argv)
    else:
        quiet_transformers(args.verbose)
        wrong = runtime_problem(args.runtime, args.device, args.dtype)
    if not wrong and args.runtime == "openvino" and args.dtype == "int8":  # calibrated on a batch's input
        wrong = "--runtime openvino serves float32; int8 is served by --runtime onnxruntime --dtype int8"
    return wrong


def build_app(args, access):
    """The engine (the model loaded) and the app serving it. ExampleError, ValueError or
    OSError where the folder cannot be served."""
    from packed_transformers.serving.api import RequestLimits
    from packed_transformers.serving.app import create_app
    from packed_transformers.serving.engines import load_engine
    from packed_transformers.serving.policies import PolicySettings
    from packed_transformers.serving.scheduler import QueueLimits

    engine = load_engine(
        args.model, args.device, args.attention_backend, args.dtype, args.pooling, args.runtime
    )
    policy = PolicySettings(
        args.policy, args.max_batch_tokens, engine.max_length, tuple(args.widths), args.batch_size,
        args.max_sequences_per_pack or default_sequences_per_pack(engine.task), args.algorithm,
        pad_to=engine.max_sequence_length,
    )  # fmt: skip
    queue = QueueLimits(args.max_queue, args.max_wait_ms, args.timeout_s)
    limits = RequestLimits(
        args.max_body_bytes, args.max_client_batch_size, body_timeout_s=args.body_timeout_s
    )
    return engine, create_app(engine, policy, queue, limits, args.tokenizer_threads, access)


def listening_socket(host: str, port: int):
    """A TCP socket bound to host:port, taken before the model loads (OSError: the port is busy,
    or not ours to take), so a second server on a port says so at once, not after loading."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve_until_stopped(app, args, sock) -> str:
    """uvicorn on `sock` until SIGTERM or SIGINT -> the line that says how it stopped and what
    it answered. uvicorn shuts down gracefully on either, then raises the signal again for the
    handler that was there before it; the handlers set here make that a normal exit (0), not a kill."""
    import uvicorn

    from packed_transformers.serving.headers import HeadLimits, bounded_protocol

    stopped_by = []
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda received, frame: stopped_by.append(received))
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=args.timeout_s,
        http=bounded_protocol(HeadLimits(args.max_header_bytes, args.header_timeout_s)),
    )  # fmt: skip
    uvicorn.Server(config).run(sockets=[sock])
    samples = app.state.metrics.requests.collect()[0].samples
    answered = {s.labels["status"]: int(s.value) for s in samples if s.name.endswith("_total")}
    return (
        f"stopped{' by signal ' + str(stopped_by[0]) if stopped_by else ''}; requests by status: {answered}"
    )


def main(argv=None) -> int:
    args = serve_parser().parse_args(argv)
    wrong = argument_mistake(args)  # before torch is imported
    if wrong:
        return refuse(wrong)
    from packed_transformers.serving.access import AccessRules

    try:  # before the model loads: an empty key is refused at once
        access = AccessRules.for_bind(args.host, args.api_key, args.allowed_hosts)
    except ValueError as err:
        return refuse(err)
    wrong = runtime_mistake(args, argv)
    if wrong:
        return refuse(wrong)
    from packed_transformers.data.classification_data import ExampleError

    try:
        sock = listening_socket(args.host, args.port)
    except OSError as err:  # a second server on the port: said before the model loads
        return refuse(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({err.strerror or err}); "
                      "is another server there? give another --port")  # fmt: skip
    try:
        engine, app = build_app(args, access)
    except (ExampleError, ValueError) as err:
        sock.close()
        return refuse(err)
    except OSError as err:
        sock.close()
        return refuse(f"{args.model}: {err.strerror or err}")
    if engine.runtime_chosen:
        print(engine.runtime_chosen, file=sys.stderr)
    print(f"serving {args.model} ({engine.task}, policy {args.policy}, runtime {engine.runner.runtime}) on "
          f"http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)  # fmt: skip
    print(serve_until_stopped(app, args, sock), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
