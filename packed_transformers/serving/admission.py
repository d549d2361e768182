"""Whether the queue admits a request now: a decision as a pure function, and the measured
speed it decides on.

A server should answer 429 at once to a request that could not run before its deadline,
rather than 504 after the wait. That needs the time the queue ahead of the request (and
the request itself) will take, which the worker learns from the batches it runs. The time
of a forward is not proportional to its tokens: a one-word batch is mostly fixed cost, so
its tokens/s is several times lower than a full batch's. One rate for all batch sizes,
learned from a run of tiny requests, refused a large request the server ran in a third of
the time it predicted, and since a refused request never runs, the estimate never learned
otherwise (reliability 5, defect 2). Hence:

- the rate is measured per batch-size bucket (real tokens, powers of two), from batches
  the worker actually ran;
- the queue is predicted as the batches it would run in (full budgets, then the rest),
  each at the rate of its own bucket, else of the nearest measured bucket above it (a
  larger batch is not slower per token), else of the bucket just below (at most 2x smaller:
  a budget's full batch often holds a little less than the budget); where nothing that
  close was measured there is no evidence, and the request is admitted (its deadline still
  bounds the wait: 504);
- a request that would run now on an empty queue is never refused for time;
- a cold server (no batch run yet) decides on a first estimate, `prior_tokens_per_second`:
  the engine's conservative guess from its model's size (serving/engines.py), replaced by
  what the first batches measure. Without it a burst of large requests on a fresh server was
  all admitted and then answered 504 after the timeout (reliability 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Admit a request only if the queue ahead of it, with it, runs within this share of the
# timeout (the rest is slack for a slower spell of the machine).
ADMIT_WITHIN = 0.5
# Weight of the newest batch in a bucket's moving average of tokens/s.
RATE_WEIGHT = 0.2


def bucket_of(tokens: int) -> int:
    """The batch-size bucket of a batch of `tokens` real tokens: floor(log2(tokens))."""
    return max(int(tokens), 1).bit_length() - 1


@dataclass
class MeasuredRates:
    """tokens/s per bucket (bucket_of), a moving average over the batches run at that size."""

    tokens_per_second: dict[int, float] = field(default_factory=dict)
    prior_tokens_per_second: float | None = None  # before any batch has run; None: no estimate

    def observe(self, tokens: int, seconds: float) -> None:
        """One batch the worker ran: `tokens` real tokens in `seconds` of forward."""
        if tokens <= 0:
            return
        rate = tokens / max(seconds, 1e-6)
        key = bucket_of(tokens)
        old = self.tokens_per_second.get(key)
        self.tokens_per_second[key] = rate if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * rate

    def rate_for(self, tokens: int) -> float | None:
        """tokens/s for a batch of `tokens`: its bucket's, else the nearest measured bucket
        above, else the bucket just below; None if none of these was measured. Before any
        batch was measured: the prior (None where there is none)."""
        if not self.tokens_per_second:  # cold: the first estimate, if any
            return self.prior_tokens_per_second
        key = bucket_of(tokens)
        above = sorted(k for k in self.tokens_per_second if k >= key)
        if above:
            return self.tokens_per_second[above[0]]
        return self.tokens_per_second.get(key - 1)

    def seconds_for(self, tokens: int, max_batch_tokens: int) -> float | None:
        """Predicted seconds to run `tokens` queued tokens as batches of at most
        `max_batch_tokens`; None where a batch's size has no measured bucket at or above."""
        full, rest = divmod(int(tokens), max(int(max_batch_tokens), 1))
        seconds = 0.0
        for count, size in ((full, max_batch_tokens), (1 if rest else 0, rest)):
            if count == 0:
                continue
            rate = self.rate_for(size)
            if rate is None:
                return None
            seconds += count * size / rate
        return seconds


def refusal(
    queued_sequences: int,
    queued_tokens: int,
    request_sequences: int,
    request_tokens: int,
    rates: MeasuredRates,
    max_queue_sequences: int,
    max_batch_tokens: int,
    timeout_s: float,
) -> str | None:
    """Why the queue cannot admit this request now (the 429's message), or None to admit.

    queued_*: what waits ahead of it (sequences, real tokens); request_*: the request's own.
    The 413 case (more sequences than the queue could ever hold) is the caller's."""
    if queued_sequences + request_sequences > max_queue_sequences:
        return (
            f"the queue holds {queued_sequences} of {max_queue_sequences} sequences; this request "
            f"has {request_sequences}"
        )
    if queued_sequences == 0:  # it would run now: no measured speed may keep it out
        return None
    total = queued_tokens + request_tokens
    seconds = rates.seconds_for(total, max_batch_tokens)
    if seconds is not None and seconds > ADMIT_WITHIN * timeout_s:
        return (
            f"the queue ({queued_sequences} sequences waiting) with this request would take "
            f"{seconds:.1f} s at the speed measured for its batch sizes; requests must run within "
            f"{timeout_s:g} s"
        )
    return None
