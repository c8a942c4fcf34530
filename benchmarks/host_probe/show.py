"""Prints the host timing probe's files (`sitecustomize.py` beside this): per process, per timed function, its calls,
total, median and p90 (quarter-octave buckets, so about ±9 %), max, and rows per call.

    python benchmarks/host_probe/show.py DIR
"""

import glob
import json
import os
import sys


def main() -> None:
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "probe-*.json"))):
        print(f"== {os.path.basename(path)}")
        with open(path) as f:
            stats = json.load(f)
        for name, v in sorted(stats.items()):
            print(
                f"  {name:24s} calls {v['count']:7d}  total {v['total_ms']:9.1f} ms  median {v['median_ms']:.3f}"
                f"  p90 {v['p90_ms']:.3f}  max {v['max_ms']:.2f}  rows {v['mean_rows']:.1f}"
            )


if __name__ == "__main__":
    main()
