"""The server's Prometheus metrics (prometheus_client, one registry per app).

packed_requests_total{status}        requests answered, by HTTP status (every request
                                     the server reads ends in exactly one)
packed_request_seconds               latency of answered requests (admission to answer)
packed_queue_seconds                 per sequence: admission to the start of its batch
packed_queue_sequences               sequences waiting now
packed_queue_tokens                  their real tokens
packed_batches_total                 forwards run
packed_batch_sequences               sequences per forward
packed_batch_tokens                  padded tokens per forward (rows x width)
packed_real_tokens_total, packed_padded_tokens_total
                                     their ratio is the real-token fraction
packed_batch_real_token_fraction     per forward
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "packed_requests", "Requests answered, by HTTP status", ["status"], registry=r
        )
        self.latency = Histogram(
            "packed_request_seconds", "Admission to answer", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_seconds = Histogram(
            "packed_queue_seconds",
            "Per sequence: admission to its batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_size = Gauge("packed_queue_sequences", "Sequences waiting", registry=r)
        self.queue_tokens = Gauge("packed_queue_tokens", "Real tokens of the sequences waiting", registry=r)
        self.batches = Counter("packed_batches", "Forwards run", registry=r)
        self.batch_sequences = Histogram(
            "packed_batch_sequences", "Sequences per forward", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "packed_batch_tokens", "Padded tokens per forward", buckets=TOKEN_BUCKETS, registry=r
        )
        self.real_tokens = Counter("packed_real_tokens", "Real tokens run", registry=r)
        self.padded_tokens = Counter("packed_padded_tokens", "Padded tokens run (rows x width)", registry=r)
        self.real_fraction = Histogram(
            "packed_batch_real_token_fraction", "Real / padded tokens per forward",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0), registry=r,
        )  # fmt: skip

    def observe_batch(self, real_tokens: int, padded_tokens: int, sequences: int) -> None:
        self.batches.inc()
        self.batch_sequences.observe(sequences)
        self.batch_tokens.observe(padded_tokens)
        self.real_tokens.inc(real_tokens)
        self.padded_tokens.inc(padded_tokens)
        self.real_fraction.observe(real_tokens / padded_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)
