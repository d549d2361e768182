"""Tasks over worker processes, for pack and verify: each worker opens the inputs once
(the pool initializer), tasks are small picklable records, results come back in task order."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing

from tqdm import tqdm

_SOURCES: list = []  # this process's open inputs, set by the pool initializer


def _init_worker(sources) -> None:
    global _SOURCES
    _SOURCES = sources


def worker_source(file_index: int):
    """Input `file_index` as opened for this worker process."""
    return _SOURCES[file_index]


def run_tasks(fn, tasks, workers: int, sources, progress: tqdm | None = None, weight=None) -> list:
    """Results of fn over tasks, in task order, on `workers` processes (inline for 1).
    `weight(task, result)` is how far a finished task moves `progress` (default 1)."""
    results = [None] * len(tasks)
    if workers <= 1 or len(tasks) <= 1:
        _init_worker(sources)
        for i, task in enumerate(tasks):
            results[i] = fn(task)
            if progress is not None:
                progress.update(weight(task, results[i]) if weight else 1)
        return results
    context = multiprocessing.get_context("fork")
    with cf.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(sources,)
    ) as pool:
        futures = {pool.submit(fn, task): i for i, task in enumerate(tasks)}
        try:
            for future in cf.as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                if progress is not None:
                    progress.update(weight(tasks[i], results[i]) if weight else 1)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return results
