"""The online server under load: the three batching policies side by side, real HTTP.

    python bench/bench_serve.py [--model FOLDER] [--seconds 20] [--overload-seconds 30]

The model: a `finetune.train` folder (--model), or configs/finetune_bbc.yaml fine-tuned
for one epoch here (MiniLM-L6). Requests: one BBC News input each, drawn at random with
replacement: --workload pairs (title + first sentence, what the model was fine-tuned on;
a narrow spread of lengths) or mixed (title + the first 1-8 sentences; a wide spread),
both to /predict; or --workload embed: BBC titles, sentences and paragraphs (short and long
mixed, data/embedding_texts.py) to /embed of the MiniLM sentence-transformers folder.
For each policy a fresh `python -m packed_transformers.serving` subprocess on 127.0.0.1:

  saturation   closed loop: --concurrency clients, each sending its next request when the
               last is answered, for --seconds; answered requests per second; --rounds
               rounds, policies interleaved and rotated, a fresh server each; the median
  load         open loop: Poisson arrivals at 50% and 80% of the padded policy's
               saturation rate for --seconds; p50 / p99 latency of answered requests
               (arrival to answer, measured by the client)
  real-token fraction   from the server's /metrics (real / padded tokens over the run)

Then the packed policy at 2x its saturation rate for --overload-seconds: statuses, p99 of
the answered, the server's peak resident memory, and whether the server's count of
answers equals the client's (nothing admitted lost). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import description as machine_description  # noqa: E402
from packed_transformers.finetune.config import load_finetune_config  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "finetune_bbc.yaml"
REPO = Path(__file__).resolve().parent.parent
POLICIES = ("padded", "fifo-tokens", "packed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, policy: str, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "packed_transformers.serving", "--model", str(model), "--port", str(self.port),
                "--policy", policy, *extra]  # fmt: skip
        self.process = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)

    def __enter__(self):
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError(f"server did not start: {self.process.stderr.read()}")

    def peak_rss_mib(self) -> float:
        import psutil

        # Linux: VmHWM is the peak resident set of the process so far.
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def metrics(self) -> dict[str, float]:
        import httpx

        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Connections:
    """Keep-alive HTTP/1.1 connections to the server, written by hand on asyncio streams:
    on a 2-core machine the load generator shares the CPU with the server, and a full
    client library costs about a millisecond of CPU per request, enough to starve the
    server of requests. Requests are pre-encoded JSON; responses are read by Content-Length."""

    def __init__(self, port: int):
        self.port, self.idle = port, []

    async def post(self, path: str, body: bytes) -> int:
        reused = bool(self.idle)
        try:
            return await self._post(path, body)
        except ConnectionError:
            if not reused:
                raise
            # The server closed an idle keep-alive connection (uvicorn: after 5 s) before
            # this request reached it: send it again on a new one, as HTTP clients do.
            self.idle.clear()
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> int:
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 20)
        head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        try:
            await writer.drain()
            status_line = await reader.readline()
        except (ConnectionResetError, BrokenPipeError):
            status_line = b""
        if not status_line:
            writer.close()
            raise ConnectionError("the server closed the connection")
        status, length, keep = int(status_line.split()[1]), 0, True
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and value.strip().lower() == "close":
                keep = False
        await reader.readexactly(length)
        if keep:
            self.idle.append((reader, writer))
        else:
            writer.close()
        return status

    def close(self):
        for _, writer in self.idle:
            writer.close()


def encode_requests(texts: list) -> list[bytes]:
    return [json.dumps({"inputs": text, "truncate": True}).encode() for text in texts]


ROUTE = {"pairs": "/predict", "mixed": "/predict", "embed": "/embed"}
route = "/predict"  # the workload's, set in main


async def closed_loop(port: int, bodies: list[bytes], clients: int, seconds: float, seed: int) -> dict:
    """`clients` clients, each sending its next request when its last is answered."""
    stop = time.monotonic() + seconds
    done, latencies = [], []
    connections = Connections(port)

    async def one_client(k):
        local = np.random.default_rng(seed + k)
        while time.monotonic() < stop:
            body = bodies[int(local.integers(len(bodies)))]
            began = time.monotonic()
            done.append(await connections.post(route, body))
            latencies.append(time.monotonic() - began)

    began = time.monotonic()
    await asyncio.gather(*(one_client(k) for k in range(clients)))
    elapsed = time.monotonic() - began
    connections.close()
    return {
        "rate": done.count(200) / elapsed,
        "statuses": {s: done.count(s) for s in set(done)},
        "p50": _q(latencies, 50),
    }


async def open_loop(port: int, bodies: list[bytes], rate: float, seconds: float, seed: int) -> dict:
    """Poisson arrivals at `rate` per second for `seconds`, each on a free connection."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, size=int(rate * seconds * 1.5) + 1)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < seconds]
    results = []
    connections = Connections(port)

    async def one(at, body):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        try:
            results.append((await connections.post(route, body), time.monotonic() - sent))
        except (OSError, ConnectionError, asyncio.IncompleteReadError) as err:
            results.append((type(err).__name__, time.monotonic() - sent))

    start = time.monotonic()
    picks = rng.integers(len(bodies), size=len(arrivals))
    await asyncio.gather(*(one(at, bodies[int(i)]) for at, i in zip(arrivals, picks)))
    elapsed = time.monotonic() - start
    connections.close()
    ok = [latency for status, latency in results if status == 200]
    statuses = {}
    for status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    return {
        "sent": len(results),
        "answered_per_second": len(ok) / elapsed,
        "p50": _q(ok, 50),
        "p99": _q(ok, 99),
        "statuses": statuses,
    }


def _q(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def fine_tuned_model(folder: Path, train_seconds: float | None = None) -> Path:
    """configs/finetune_bbc.yaml fine-tuned for one epoch (or `train_seconds` of it)."""
    from packed_transformers.finetune.train import run_finetune

    config = load_finetune_config(CONFIG, ["training.progress=false"])
    one = copy.deepcopy(config)
    one["training"]["epochs"] = 1
    one["training"]["max_seconds"] = train_seconds
    run_finetune(one, folder / "run")
    return folder / "run" / "model"


def embed_texts(seed: int = 0) -> list[str]:
    """BBC titles, sentences and paragraphs in corpus order, 4,000 drawn at random."""
    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    texts = texts_of(bbc_articles(corpus_glob()), "mixed")
    picks = np.random.default_rng(seed).choice(len(texts), size=min(4000, len(texts)), replace=False)
    return [texts[i] for i in picks]


def bbc_texts(workload: str = "pairs", seed: int = 0) -> list:
    """One TEI input per BBC News article. pairs: [title, first sentence] (the pair the
    model was fine-tuned on; 23-63 tokens); mixed: [title, the first k sentences], k drawn
    from 1..8 (about 25-400 tokens: a wide spread of lengths, cut at 512 by truncate)."""
    import glob

    from packed_transformers.data.create_pretraining_data import read_document, split_sentences
    from packed_transformers.finetune.train import resolve_asset

    config = load_finetune_config(CONFIG, ["training.progress=false"])
    rng = np.random.default_rng(seed)
    out = []
    for path in sorted(glob.glob(resolve_asset(config["data"]["train_file"]))):
        lines = [line.strip() for line in read_document(Path(path))[0].splitlines() if line.strip()]
        body = split_sentences("\n".join(lines[1:]))
        k = 1 if workload == "pairs" else int(rng.integers(1, 9))
        out.append([lines[0], " ".join(body[:k])] if body else lines[0])
    return out


def refused(runtime: str, dtype: str) -> bool:
    """Whether this machine refuses `runtime` in `dtype` (say so, and leave that variant out)."""
    from packed_transformers.inference.runner import runtime_problem

    problem = runtime_problem(runtime, "cpu", dtype)
    if problem:
        print(f"left out: --runtime {runtime} --dtype {dtype}: {problem}", file=sys.stderr)
    return problem is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a finetune.train model folder (default: fine-tune one)")
    parser.add_argument(
        "--train-seconds", type=float, help="without --model: fine-tune for this long, not an epoch"
    )
    parser.add_argument("--seconds", type=float, default=20, help="per measurement")
    parser.add_argument("--overload-seconds", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=128, help="closed-loop clients at saturation")
    parser.add_argument("--rounds", type=int, default=3, help="saturation rounds (median kept)")
    parser.add_argument("--workload", default="pairs", choices=tuple(ROUTE), help="see the docstring")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument(
        "--server-args",
        default="--attention-backend sdpa",
        help="finetune.serve options for every policy, one string (default: SDPA attention, the form "
        "transformers and TEI use on CPU; it measured faster than varlen here for every policy)",
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16", "int8"),
                        help="each policy served in each dtype, interleaved in the same rounds (--dtype)")  # fmt: skip
    parser.add_argument("--runtimes", nargs="+", default=["torch"], choices=("torch", "openvino", "onnxruntime"),
                        help="each policy and dtype served through each runtime, interleaved (--runtime)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    extra = args.server_args.split()
    global route
    route = ROUTE[args.workload]
    texts = embed_texts() if args.workload == "embed" else bbc_texts(args.workload)
    bodies = encode_requests(texts)
    with tempfile.TemporaryDirectory() as scratch:
        if args.workload == "embed":
            from packed_transformers.data.assets import model_dir

            args.model = args.model or model_dir()
        model = args.model or fine_tuned_model(Path(scratch), args.train_seconds)
        # each policy in each dtype and runtime: a variant with its own server options, named
        # "policy", then " dtype" where several dtypes and " runtime" where several runtimes
        variants = {
            policy
            + (f" {dtype}" if len(args.dtypes) > 1 else "")
            + (f" {runtime}" if len(args.runtimes) > 1 else ""): (
                policy,
                [*extra, "--dtype", dtype, "--runtime", runtime],
            )
            for policy in args.policies
            for dtype in args.dtypes
            for runtime in args.runtimes
            if not refused(runtime, dtype)
        }
        results = {name: {"saturation_rounds": []} for name in variants}
        names = list(variants)
        # Saturation in interleaved rounds, the order rotated, a fresh server each time: the
        # shared machine's speed drifts (2x between runs minutes apart); the median is kept.
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for policy in order:
                with ServerProcess(model, *variants[policy]) as server:
                    run = asyncio.run(
                        closed_loop(server.port, bodies, args.concurrency, args.seconds, round_)
                    )
                results[policy]["saturation_rounds"].append(run["rate"])
                print(f"round {round_}: {policy} saturation {run}", file=sys.stderr, flush=True)
        for policy in names:
            rates = results[policy]["saturation_rounds"]
            results[policy]["saturation"] = {
                "rate": float(np.median(rates)),
                "min": min(rates),
                "max": max(rates),
            }
        reference = results.get("padded", next(iter(results.values())))["saturation"]["rate"]
        for policy in names:
            with ServerProcess(model, *variants[policy]) as server:
                for share in (0.5, 0.8):
                    run = asyncio.run(open_loop(server.port, bodies, share * reference, args.seconds, 2))
                    results[policy][f"load_{share}"] = run
                    print(f"{policy} at {share:.0%}: {run}", file=sys.stderr, flush=True)
                m = server.metrics()
                results[policy]["real_token_fraction"] = (
                    m["packed_real_tokens_total"] / m["packed_padded_tokens_total"]
                )
        overload = None
        if "packed" in results and args.overload_seconds > 0:
            rate = 2 * results["packed"]["saturation"]["rate"]
            with ServerProcess(model, *variants["packed"]) as server:
                run = asyncio.run(open_loop(server.port, bodies, rate, args.overload_seconds, 3))
                m = server.metrics()
                counted = {k: int(v) for k, v in m.items() if k.startswith("packed_requests_total")}
                overload = {
                    "rate": rate,
                    **run,
                    "server_counts": counted,
                    "peak_rss_mib": server.peak_rss_mib(),
                }
    print(
        f"# {len(texts)} BBC News inputs ({args.workload}, {route}), one per request; {args.seconds:g} s per measurement"
    )
    print(
        "| policy | saturation, requests/s, median (range) | p50 / p99 at 50% load, ms | p50 / p99 at 80% load, ms "
        "| real-token fraction |"
    )
    print("|---|---|---|---|---|")
    for policy, r in results.items():
        loads = [r[f"load_{s}"] for s in (0.5, 0.8)]
        cells = " | ".join(f"{x['p50'] * 1000:.0f} / {x['p99'] * 1000:.0f}" for x in loads)
        sat = r["saturation"]
        print(
            f"| {policy} | {sat['rate']:.1f} ({sat['min']:.1f}-{sat['max']:.1f}) | {cells} | {r['real_token_fraction']:.3f} |"
        )
    for policy in ("padded", "fifo-tokens"):
        if policy in results and "packed" in results:
            ratio = results["packed"]["saturation"]["rate"] / results[policy]["saturation"]["rate"]
            print(f"\npacked / {policy} at saturation: {ratio:.2f}x")
    for policy in args.policies:
        rates = {d: results.get(f"{policy} {d}", {}).get("saturation", {}).get("rate") for d in args.dtypes}
        for dtype in ("int8", "bfloat16"):
            if rates.get(dtype) and rates.get("float32"):
                print(f"\n{policy}: {dtype} / float32 at saturation: {rates[dtype] / rates['float32']:.2f}x")
    if len(args.runtimes) > 1:  # every variant against torch float32's of its policy
        for name in names:
            policy = name.split(" ")[0]
            base = next((n for n in names if n.split(" ")[0] == policy and n.endswith(" torch")
                         and ("float32" in n or len(args.dtypes) == 1)), None)  # fmt: skip
            if base and name != base:
                ratio = results[name]["saturation"]["rate"] / results[base]["saturation"]["rate"]
                print(f"\n{name} / {base} at saturation: {ratio:.2f}x")
    if overload:
        print(f"\noverload: packed at {overload['rate']:.0f} requests/s (2x its saturation) for {args.overload_seconds:g} s: "
              f"{overload['sent']} sent, statuses {overload['statuses']}, p99 of answered {overload['p99'] * 1000:.0f} ms, "
              f"server peak RSS {overload['peak_rss_mib']:.0f} MiB, server's counts {overload['server_counts']}")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "policies": results,
                    "overload": overload,
                    "dtypes": args.dtypes,
                    "runtimes": args.runtimes,
                    "machine": machine_description(),
                    "command": " ".join(sys.argv),
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
