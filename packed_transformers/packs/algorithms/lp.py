"""`lp`: cutting-stock LP relaxation by column generation, then integer repair.

The packing problem over a histogram is a cutting-stock problem: items are
sequence lengths l with demand h_l, "rolls" are packs of N tokens holding at most
K sequences, and a pattern (strategy) is a multiset of lengths that fits.

    minimise  sum_p x_p   subject to  sum_p a_lp x_p >= h_l  for every l,  x >= 0

1. Column generation: solve the restricted LP with HiGHS (scipy.optimize.linprog),
   read the duals pi_l, and price new patterns by dynamic programming over
   capacity and depth (a knapsack: maximise sum pi_l a_l, sum l a_l <= N,
   sum a_l <= K). Stop when no pattern has value > 1: the LP optimum, whose
   objective is a lower bound on the packs of ANY packing (reported as
   `extra["lp_bound_packs"]`).
2. Round down, then pack what is left (a few hundred sequences) with an integer
   program over the generated patterns (HiGHS MILP via scipy.optimize.milp,
   limited in branch-and-bound nodes, never in seconds: a wall-clock limit made the plan
   depend on the machine's speed and load, and the job fingerprint promises the same
   bytes everywhere), falling back to LPFHP; keep whichever uses fewer packs.
3. Remove surplus copies of over-covered lengths (never adds a pack).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # scipy is imported where a program is solved: packing with another
    import scipy.sparse  # algorithm (embed, predict, the server) pays nothing for it

from packed_transformers.packs.algorithms.heuristics import lpfhp
from packed_transformers.packs.algorithms.nnlshp import exact_fill_strategies
from packed_transformers.packs.errors import PackingBugError
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import remove_excess

PRICING_TOLERANCE = 1e-9
MAX_ITERATIONS = 500
COLUMNS_PER_ITERATION = 64
# The residual program's work limit: HiGHS's branch-and-bound nodes (deterministic). On
# the Wikipedia-512 histogram the root node alone lands within 7 packs of the LP bound
# (8,143,835 vs 8,143,828.9 at K=3; the old 2 s time limit gave 8,143,863) in ~6 s.
MILP_NODES = 10


def lp_pack(histogram: Histogram, depth: int):
    n = histogram.max_sequence_length
    pool = _ColumnPool(histogram)
    pool.add(s for s, _ in lpfhp(histogram, depth))
    pool.add((int(length),) for length in pool.present)
    # Every pattern of <= 3 present lengths that fills a pack exactly: good columns from
    # the start cut column-generation iterations (each a cold HiGHS solve) several-fold.
    present = set(pool.present.tolist())
    pool.add(
        tuple(int(v) for v in row if v)
        for row in exact_fill_strategies(n, min(depth, 3))
        if all(v in present for v in row if v)
    )
    demand = histogram.counts[pool.present - 1].astype(np.float64)
    pricer = _Pricer(n, depth, pool.present)
    iterations = 0
    for iterations in range(1, MAX_ITERATIONS + 1):  # noqa: B007 - read after the loop
        x, duals = _solve_restricted_lp(pool.matrix(), demand)
        new = pricer.best_patterns(duals, COLUMNS_PER_ITERATION)
        if not pool.add(new):
            break
    else:
        raise PackingBugError(f"lp: column generation did not converge in {MAX_ITERATIONS} iterations")
    lp_bound = float(x.sum())

    whole = np.floor(x + 1e-9).astype(np.int64)
    pairs = [(pool.strategies[i], int(whole[i])) for i in np.flatnonzero(whole)]
    covered = pool.matrix() @ whole
    residual = np.zeros(n, dtype=np.int64)
    residual[pool.present - 1] = np.maximum(histogram.counts[pool.present - 1] - covered, 0)
    if residual.any():
        pairs += _pack_residual(Histogram(residual), depth, pool)
    return remove_excess(pairs, histogram), {
        "lp_bound_packs": lp_bound,
        "lp_bound_efficiency": histogram.real_tokens / (lp_bound * n),
        "column_generation_iterations": iterations,
        "columns": len(pool.strategies),
    }


class _ColumnPool:
    """Distinct patterns generated so far, with their sparse matrix over present lengths."""

    def __init__(self, histogram: Histogram):
        self.present = np.flatnonzero(histogram.counts) + 1  # lengths with demand > 0
        self._row_of = {int(length): i for i, length in enumerate(self.present)}
        self.strategies: list[tuple[int, ...]] = []
        self._seen: set[tuple[int, ...]] = set()
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._matrix = None

    def add(self, strategies) -> int:
        added = 0
        for s in strategies:
            s = tuple(sorted(s, reverse=True))
            if s in self._seen:
                continue
            self._seen.add(s)
            column = len(self.strategies)
            self.strategies.append(s)
            for length in s:
                self._rows.append(self._row_of[length])
                self._cols.append(column)
            added += 1
        if added:
            self._matrix = None
        return added

    def matrix(self) -> scipy.sparse.csc_matrix:
        """[present lengths, patterns]: copies of each length in each pattern."""
        import scipy.sparse

        if self._matrix is None:
            self._matrix = scipy.sparse.csc_matrix(
                (np.ones(len(self._rows)), (self._rows, self._cols)),
                shape=(len(self.present), len(self.strategies)),
            )
        return self._matrix


def _solve_restricted_lp(a: scipy.sparse.csc_matrix, demand: np.ndarray):
    import scipy.optimize

    result = scipy.optimize.linprog(
        np.ones(a.shape[1]),
        A_ub=-a,
        b_ub=-demand,
        bounds=(0, None),
        method="highs",
    )
    if result.status != 0:
        raise PackingBugError(f"lp: HiGHS failed on the restricted LP: {result.message}")
    return result.x, -result.ineqlin.marginals  # duals of the >= rows, all >= 0


class _Pricer:
    """Knapsack pricing: the patterns of largest dual value that fit N tokens and K sequences.

    Finite depth: layered DP, best[k][c] = max value with at most k items in at most c
    tokens, one (max, +) product per layer. When the depth cannot bind (K >= N divided
    by the shortest length) a single unbounded-knapsack DP over capacity is used.
    """

    def __init__(self, n: int, depth: int, present: np.ndarray):
        self.n = n
        self.present = present
        self.unbounded = depth >= n // int(present.min())
        self.depth = depth
        # shifted[c, j] = c - present[j]: where an item of length present[j] leaves capacity c.
        self._shifted = np.arange(n + 1)[:, None] - present[None, :]
        self._fits = self._shifted >= 0
        self._shifted = np.where(self._fits, self._shifted, 0)

    def best_patterns(self, duals: np.ndarray, limit: int) -> list[tuple[int, ...]]:
        values = np.where(duals > 0, duals, 0.0)
        if self.unbounded:
            best, backtrack = self._unbounded(values)
            rest_after = lambda j: best[self.n - self.present[j]]  # noqa: E731
        else:
            layers, choices = self._layered(values)
            best = layers[-1]
            backtrack = lambda c: self._backtrack_layered(choices, self.depth - 2, c)  # noqa: E731
            rest_after = lambda j: layers[-2][self.n - self.present[j]]  # noqa: E731
        # The best pattern that contains each length j: values[j] + best completion.
        candidates = []
        for j in np.flatnonzero(values > 0):
            total = values[j] + rest_after(j)
            if total > 1.0 + PRICING_TOLERANCE:
                candidates.append((total, j))
        candidates.sort(reverse=True)
        patterns = []
        for _, j in candidates[:limit]:
            length = int(self.present[j])
            patterns.append((length,) + backtrack(self.n - length))
        return patterns

    def _layered(self, values):
        layers = [np.zeros(self.n + 1)]
        choices = []
        for _ in range(self.depth):
            previous = layers[-1]
            candidates = np.where(self._fits, previous[self._shifted] + values[None, :], -np.inf)
            j = candidates.argmax(axis=1)
            gain = candidates[np.arange(self.n + 1), j]
            take = gain > previous + 1e-15
            layers.append(np.where(take, gain, previous))
            choices.append(np.where(take, j, -1))
        return layers, choices

    def _backtrack_layered(self, choices, k, capacity) -> tuple[int, ...]:
        items = []
        while k >= 0 and capacity > 0:
            j = choices[k][capacity]
            if j >= 0:
                items.append(int(self.present[j]))
                capacity -= int(self.present[j])
            k -= 1
        return tuple(items)

    def _unbounded(self, values):
        best = np.zeros(self.n + 1)
        choice = np.full(self.n + 1, -1)
        for c in range(1, self.n + 1):
            fits = self._fits[c]
            options = np.where(fits, best[self._shifted[c]] + values, -np.inf)
            j = int(options.argmax())
            if options[j] > best[c - 1] + 1e-15:
                best[c], choice[c] = options[j], j
            else:
                best[c], choice[c] = best[c - 1], -1

        def backtrack(capacity):
            items = []
            while capacity > 0:
                j = choice[capacity]
                if j < 0:
                    capacity -= 1
                else:
                    items.append(int(self.present[j]))
                    capacity -= int(self.present[j])
            return tuple(items)

        return best, backtrack


def _pack_residual(residual: Histogram, depth: int, pool: _ColumnPool):
    """Pack the few sequences the rounded LP leaves: an integer program over the pool's
    patterns that fit the residual counts, or LPFHP, whichever needs fewer packs."""
    import scipy.optimize
    import scipy.sparse

    heuristic = lpfhp(residual, depth)
    heuristic_packs = sum(c for _, c in heuristic)
    counts = residual.counts
    usable = [s for s in pool.strategies if _fits_counts(s, counts)]
    usable += [s for s, _ in heuristic if s not in set(usable)]
    present = np.flatnonzero(counts) + 1
    row_of = {int(length): i for i, length in enumerate(present)}
    rows, cols = [], []
    for col, s in enumerate(usable):
        for length in s:
            rows.append(row_of[length])
            cols.append(col)
    a = scipy.sparse.csc_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(present), len(usable)))
    demand = counts[present - 1].astype(np.float64)
    result = scipy.optimize.milp(
        np.ones(len(usable)),
        constraints=scipy.optimize.LinearConstraint(a, lb=demand, ub=np.inf),
        integrality=np.ones(len(usable)),
        bounds=scipy.optimize.Bounds(0, demand.max()),
        options={"node_limit": MILP_NODES, "disp": False},
    )
    if result.x is None:
        return heuristic
    chosen = np.rint(result.x).astype(np.int64)
    if chosen.sum() >= heuristic_packs or ((a @ chosen) < demand).any():
        return heuristic
    return [(usable[i], int(chosen[i])) for i in np.flatnonzero(chosen)]


def _fits_counts(strategy, counts) -> bool:
    for length in set(strategy):
        if strategy.count(length) > counts[length - 1]:
            return False
    return True
