"""Non-negative least-squares histogram packing (NNLSHP), Krell et al. 2021.

Enumerate every strategy of at most 3 lengths that fills a pack exactly
(sum = N), solve the weighted least-squares problem
    min_x || w * (A x - h) ||,  x >= 0,
where A[l, s] counts length l+1 in strategy s and w down-weights the residual of
the 8 shortest lengths (0.09, as published), round x to the nearest integer,
pack the sequences left over with LPFHP, and take out surplus copies
(the published code kept them as "padding sequences"; we remove them, which
leaves the packs and the efficiency unchanged and makes the plan exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where solved (see packs/algorithms/lp.py)
    import scipy.sparse

from packed_transformers.packs.algorithms.heuristics import lpfhp
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import remove_excess

MAX_DEPTH = 3
SHORT_LENGTHS = 8  # lengths 1..8 get the smaller residual weight
SHORT_WEIGHT = 0.09
FISTA_SUPPORT_THRESHOLD = 100.0  # packs; smaller repeat counts are noise of the approximation
COLUMN_BATCH = 500


def exact_fill_strategies(n: int, depth: int) -> np.ndarray:
    """All multisets of at most `depth` (<= 3) lengths summing to exactly n, as an int64
    array [strategies, depth] padded with 0, each row sorted longest first."""
    rows = [(n, 0, 0)]
    if depth >= 2:
        rows += [(n - a, a, 0) for a in range(1, n // 2 + 1)]
    if depth >= 3:
        for c in range(1, n // 3 + 1):  # c <= b <= a, a + b + c = n
            for b in range(c, (n - c) // 2 + 1):
                rows.append((n - b - c, b, c))
    return np.array(rows, dtype=np.int64)[:, :depth]


def _weighted_nnls(a: scipy.sparse.csr_matrix, b: np.ndarray) -> np.ndarray:
    """Solve min ||a x - b||, x >= 0, exactly (KKT-checked over every column), fast.

    a has ~22,000 columns at N=512, K=3, and at most N of them are positive at the
    optimum. Calling scipy.optimize.nnls on all of them takes ~18 s; worse, its
    1.12-1.15 rewrite regressed (maxiter errors, non-optimal points on the full
    MLPerf histogram). So: (1) a few thousand cheap projected-gradient (FISTA) steps
    on the sparse matrix find the likely support; (2) nnls on that small column set;
    (3) columns whose gradient is still negative join the set, until the KKT
    conditions hold for ALL columns, so the answer is an exact NNLS optimum.
    If that does not converge, fall back to nnls on every column, then to bvls.
    """
    import scipy.optimize

    dense = a.toarray()
    a_t = a.T.tocsr()
    tolerance = 1e-9 * max(1.0, float(np.abs(a_t @ b).max()))
    x = _fista_nnls(a, a_t, b, iterations=5000)
    columns = np.flatnonzero(x > FISTA_SUPPORT_THRESHOLD)
    gradient = a_t @ (a @ x - b)
    columns = np.union1d(columns, np.argsort(gradient)[:COLUMN_BATCH])
    for _ in range(50):
        try:
            sub, _ = scipy.optimize.nnls(dense[:, columns], b, maxiter=50 * len(columns))
        except RuntimeError:
            break
        x = np.zeros(a.shape[1])
        x[columns] = sub
        gradient = a_t @ (a @ x - b)
        violating = np.flatnonzero(gradient < -tolerance)
        if violating.size == 0:
            return x
        newcomers = violating[np.argsort(gradient[violating])[:COLUMN_BATCH]]
        columns = np.union1d(columns[sub > 0], newcomers)
    try:
        x, _ = scipy.optimize.nnls(dense, b, maxiter=50 * dense.shape[1])
        if _kkt_ok(dense, b, x):
            return x
    except RuntimeError:
        pass
    result = scipy.optimize.lsq_linear(dense, b, bounds=(0, np.inf), method="bvls", tol=1e-12)
    return np.maximum(result.x, 0.0)


def _fista_nnls(a, a_t, b, iterations: int) -> np.ndarray:
    """Accelerated projected gradient for min ||a x - b||^2, x >= 0 (approximate)."""
    # ||a||_2^2 <= ||a||_1 ||a||_inf: a valid step bound without an eigen-solver.
    lipschitz = float(abs(a).sum(axis=0).max() * abs(a).sum(axis=1).max())
    x = np.zeros(a.shape[1])
    y = x.copy()
    t = 1.0
    for _ in range(iterations):
        x_next = np.maximum(y - (a_t @ (a @ y - b)) / lipschitz, 0.0)
        t_next = (1.0 + np.sqrt(1.0 + 4.0 * t * t)) / 2.0
        y = x_next + ((t - 1.0) / t_next) * (x_next - x)
        x, t = x_next, t_next
    return x


def _kkt_ok(a, b, x, rtol=1e-6) -> bool:
    if not np.all(np.isfinite(x)) or (x < 0).any():
        return False
    gradient = a.T @ (a @ x - b)  # optimal: gradient >= 0, and == 0 where x > 0
    scale = rtol * max(1.0, float(np.abs(a.T @ b).max()))
    return bool((gradient >= -scale).all() and (np.abs(gradient[x > 0]) <= scale).all())


def nnlshp(histogram: Histogram, depth: int):
    import scipy.sparse

    n = histogram.max_sequence_length
    if depth > MAX_DEPTH:
        raise PackingInputError(
            f"nnlshp supports at most {MAX_DEPTH} sequences per pack (got {depth}): the number "
            "of strategies grows as N^(K-1); use 'lp', which handles any K"
        )
    strategies = exact_fill_strategies(n, depth)
    # A[l-1, s] = copies of length l in strategy s.
    cols = np.repeat(np.arange(len(strategies)), depth)
    lengths = strategies.reshape(-1)
    keep = lengths > 0
    a = scipy.sparse.csr_matrix(
        (np.ones(keep.sum()), (lengths[keep] - 1, cols[keep])), shape=(n, len(strategies))
    )
    weight = np.ones(n)
    weight[:SHORT_LENGTHS] = SHORT_WEIGHT
    x = _weighted_nnls(scipy.sparse.diags(weight) @ a, weight * histogram.counts.astype(np.float64))
    repeat = np.rint(x).astype(np.int64)
    pairs = [(tuple(int(v) for v in strategies[i] if v), int(repeat[i])) for i in np.flatnonzero(repeat)]
    # The published code gives every sequence the rounded solution misses a pack of its
    # own (strategy (l, N-l) with N-l counted as padding). We pack the left-overs with
    # LPFHP instead: never worse, usually a few thousand packs fewer on Wikipedia.
    residual = histogram.counts - (a @ repeat).astype(np.int64)
    if (residual > 0).any():
        pairs += lpfhp(Histogram(np.maximum(residual, 0)), depth)
    return remove_excess(pairs, histogram)
