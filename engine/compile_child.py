"""`python -m engine.compile_child FILE`: compile a runner's executables into the executable
store in a process of its own, then exit (see `ModelRunner.warmup`).

XLA's compiler leaves the memory it used with the process that ran it (glibc keeps what was
freed); a child gives it back to the system when it exits, and the serving process loads
what the child stored. FILE holds the pickled `(EngineConfig, buckets)`; the child builds
the same runner (same fingerprint, so the same store directory) and compiles each bucket.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import sys

from engine.model_runner import ModelRunner
from engine.step_table import compile_workers


def main(path: str) -> int:
    with open(path, "rb") as f:
        config, buckets = pickle.load(f)
    runner = ModelRunner(config)
    if runner.store is None:
        print("no executable store in the child", file=sys.stderr)
        return 1
    workers = compile_workers()  # as in warmup
    # What does not reach the store (a backend that cannot serialize) the parent compiles.
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(runner.compile_bucket, buckets):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
