"""How fast this host runs the kinds of host work the drafter's constrained steps do between two MTP steps: a fixed
Python loop, numpy over a batch's masks (32 rows of a 151,936-id vocabulary), thread hand-offs and a system call.
Each number is the median of many runs. Run it on the GPU machine and here to compare the hosts' speeds: the drafter's
host chain must fit inside an MTP step's forward (docs/performance.md, "Structured output").

    python benchmarks/host_speed.py
"""

from __future__ import annotations

import os
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

WORDS = -(-151_936 // 32)  # int32 words of one mask


def median_us(f, n: int = 2000) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def python_loop() -> int:
    s = 0
    for i in range(1000):
        s += i * i
    return s


def echo(inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
    while (x := inbox.get()) is not None:
        outbox.put(x)


def main() -> None:
    inbox, outbox = queue.SimpleQueue(), queue.SimpleQueue()
    threading.Thread(target=echo, args=(inbox, outbox), daemon=True).start()
    pool = ThreadPoolExecutor(1)
    masks = np.random.default_rng(0).integers(-(2**31), 2**31, (32, WORDS), dtype=np.int64).astype(np.int32)
    pairs = masks.view(np.uint64)
    rows = [
        ("a Python loop of 1,000 multiplications", median_us(python_loop)),
        ("numpy: 32 masks set to all ones", median_us(lambda: masks.fill(-1))),
        ("numpy: 32 masks' bits counted", median_us(lambda: np.bitwise_count(pairs).sum(axis=1, dtype=np.int32))),
        ("a queue round trip to another thread", median_us(lambda: (inbox.put(1), outbox.get()))),
        ("ThreadPoolExecutor submit and result", median_us(lambda: pool.submit(int).result())),
        ("os.getppid (a system call)", median_us(os.getppid, 20000)),
    ]
    inbox.put(None)
    pool.shutdown()
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, numpy {np.__version__}")
    print("| work | median µs |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
