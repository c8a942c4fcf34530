"""Host timing probe for the structured-output path: wall-clock timers around the host functions of the drafter's and
the verifier's grammar masks, in every Python process that has this directory on its path (the benchmark and the
services it starts), written to $PROBE_OUT/probe-<pid>-<program>.json every 0.2 s and at exit; show them with
`python benchmarks/host_probe/show.py DIR`. Only with PROBE_OUT set; the benchmark's own numbers (tokens/s, the
breakdown) run beside it, each timer adding about a microsecond a call.

    PROBE_OUT=DIR PYTHONPATH=benchmarks/host_probe:. python benchmarks/e2e.py --structured json ...

PROBE_WIDE=X sets the drafter's `WIDE_MASK` to X in every process: -1 masks step 0 alone (every row counts as wide),
the ceiling of what the later steps' masks cost. PROBE_THREADS=N gives llguidance's executor (the masks' threads) N
threads in every process. PROBE_INTURN=1 fills the drafter's masks (`DraftMasks.fill`) row by row on its own thread
(`benchmarks/draft_masks.py`'s `fill_in_turn`) instead of by the executor, which still fills the verifier's. Timers
nest: a function's time includes the timed functions it calls.

PROBE_TRACE=START,SPAN records a torch.profiler trace (CPU and CUDA, the timed functions as named ranges) of the
services' processes: the drafter's constrained Proposes START .. START + SPAN - 1, and the verifier's steps that run
meanwhile (the drafter marks the window with a file in PROBE_OUT), written as trace-<pid>-<program>.json.gz;
`python benchmarks/host_probe/timeline.py DIR` lays them side by side. The benchmark's own process (its in-process
engine) is not traced: a profiler started inside its Propose broke its engine's loop.
"""

import os

if os.environ.get("PROBE_OUT"):
    import atexit
    import importlib.abc
    import importlib.util
    import json
    import math
    import sys
    import threading
    import time

    STATS: dict[str, dict] = {}
    LOCK = threading.Lock()
    LAST = [time.monotonic()]
    TRACE = None
    if os.environ.get("PROBE_TRACE") and os.path.basename(sys.argv[0]) != "e2e.py":
        TRACE = [int(x) for x in os.environ["PROBE_TRACE"].split(",")]
    WINDOW = os.path.join(os.environ["PROBE_OUT"], "trace.on")  # present while the drafting process traces
    TRACING = {"prof": None, "proposes": 0, "done": False}

    def trace_start() -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        TRACING["prof"] = torch.profiler.profile(activities=activities)
        TRACING["prof"].__enter__()

    def trace_stop() -> None:
        import gzip
        import shutil

        prof, TRACING["prof"], TRACING["done"] = TRACING["prof"], None, True
        prof.__exit__(None, None, None)
        program = os.path.basename(sys.argv[0] or "py")
        path = os.path.join(os.environ["PROBE_OUT"], f"trace-{os.getpid()}-{program}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)

    def tick_propose() -> None:
        """A constrained Propose begins: the drafting process opens its window at START, closes it after SPAN."""
        if TRACE is None or TRACING["done"]:
            return
        TRACING["proposes"] += 1
        start, span = TRACE
        if TRACING["proposes"] == start:
            if TRACING["prof"] is None:
                trace_start()
            open(WINDOW, "w").close()
        elif TRACING["proposes"] == start + span:
            os.remove(WINDOW)
            trace_stop()

    def tick_verify() -> None:
        """A verify step's masks begin: a verifier process traces while the drafting process's window is open."""
        if TRACE is None or TRACING["done"] or TRACING["proposes"]:
            return
        open_now = os.path.exists(WINDOW)
        if open_now and TRACING["prof"] is None:
            trace_start()
        elif not open_now and TRACING["prof"] is not None:
            trace_stop()

    def record(name: str, seconds: float, rows: int | None) -> None:
        with LOCK:
            st = STATS.setdefault(name, {"count": 0, "total": 0.0, "max": 0.0, "rows": 0, "hist": {}})
            st["count"] += 1
            st["total"] += seconds
            st["max"] = max(st["max"], seconds)
            st["rows"] += rows or 0
            bucket = int(math.floor(4 * math.log2(max(seconds, 1e-7) * 1e6)))  # quarter octaves of microseconds
            st["hist"][bucket] = st["hist"].get(bucket, 0) + 1
        if time.monotonic() - LAST[0] > 0.2:  # servers are stopped by a signal: no exit handler runs
            LAST[0] = time.monotonic()
            dump()

    def measured(name: str, rows: int | None, f, *args, **kwargs):
        """f(*args, **kwargs), timed as `name` (a named range of the trace while one is recorded)."""
        t0 = time.perf_counter()
        try:
            if TRACING["prof"] is not None:
                import torch

                with torch.profiler.record_function(name):
                    return f(*args, **kwargs)
            return f(*args, **kwargs)
        finally:
            record(name, time.perf_counter() - t0, rows)

    def wrap(owner, attr: str, name: str, rows=None, before=None) -> None:
        """Times `owner.attr` as `name`; `rows(args)`: how many rows a call did; `before()` runs ahead of each call."""
        f = getattr(owner, attr, None)
        if f is None or getattr(f, "_probed", False):
            return

        def timed(*args, **kwargs):
            if before is not None:
                before()
            return measured(name, rows(args) if rows else None, f, *args, **kwargs)

        timed._probed = True
        setattr(owner, attr, timed)

    def grammar(mod) -> None:
        if os.environ.get("PROBE_THREADS"):  # llguidance's executor with this many threads

            def executor(self):
                if self._executor is None:
                    import llguidance

                    self._executor = llguidance.LLExecutor(int(os.environ["PROBE_THREADS"]))
                return self._executor

            mod.Grammars.executor = property(executor)
        if os.environ.get("PROBE_INTURN"):  # the drafter's masks filled row by row on its thread, not by the executor
            import llguidance.numpy

            par, drafting = llguidance.numpy.fill_next_token_bitmask_par, threading.local()

            def dispatch(executor, jobs, out):
                if getattr(drafting, "on", False):
                    from benchmarks.draft_masks import fill_in_turn  # the repository is on the path

                    return fill_in_turn(executor, jobs, out)
                return par(executor, jobs, out)

            llguidance.numpy.fill_next_token_bitmask_par = dispatch
            fill = mod.DraftMasks.fill

            def filled_in_turn(self, jobs, out):
                drafting.on = True
                try:
                    return fill(self, jobs, out)
                finally:
                    drafting.on = False

            mod.DraftMasks.fill = filled_in_turn
        wrap(mod.Grammars, "batch_masks", "verifier_batch_masks", lambda a: len(a[1]), before=tick_verify)
        wrap(mod.Grammars, "_make_matchers", "make_matchers", lambda a: len(a[1]))
        wrap(mod.Grammars, "_matcher", "matcher_lookup")
        wrap(mod.DraftMasks, "__init__", "draft_masks_init", lambda a: len(a[2]))
        wrap(mod.DraftMasks, "fill", "draft_masks_fill", lambda a: len(a[1]))
        wrap(mod.DraftMasks, "close", "draft_masks_close")
        wrap(mod, "upload_masks", "upload_masks", lambda a: len(a[0]))

    def llguidance_numpy(mod) -> None:
        wrap(mod, "fill_next_token_bitmask_par", "llguidance_fill", lambda a: len(a[1]))
        wrap(mod, "fill_next_token_bitmask_par_with_draft_tokens", "llguidance_fill_drafts", lambda a: len(a[1]))

    def later_steps(mod) -> None:
        wrap(mod.LaterStepsRun, "forward", "later_forward_replay")
        wrap(mod.LaterStepsRun, "pick", "later_pick_replay")

    def runner(mod) -> None:
        if os.environ.get("PROBE_WIDE"):
            mod.WIDE_MASK = float(os.environ["PROBE_WIDE"])
        from benchmarks.host_speed import python_loop  # host_speed.py's fixed loop (the repository is on the path)

        cls = mod.DrafterRunner
        propose = cls._propose

        def split(self, items, *args, **kwargs):
            kind = "constrained" if any(item.grammar for item in items) else "plain"
            if kind == "constrained":
                tick_propose()
            measured("canary_python_loop", None, python_loop)  # this host's speed, in the process
            return measured(f"propose_{kind}", len(items), propose, self, items, *args, **kwargs)

        cls._propose = split
        wrap(cls, "_mask_grammars", "mask_grammars", lambda a: len(a[4]))
        wrap(cls, "_masked_later_steps", "masked_later_steps")
        wrap(cls, "_mtp_step", "mtp_step_launch")
        wrap(cls, "_pick", "pick_launch")
        wrap(cls, "_plan_later_steps", "plan_later_steps")
        wrap(cls, "_to_host", "to_host")
        wrap(mod, "_widen", "widen", lambda a: len(a[1]))
        wrap(mod._DraftsCopy, "note", "drafts_copy_wait")
        wrap(mod._HostCopy, "lists", "step_tokens_wait")
        wrap(cls, "_draft_masks", "draft_masks")

    def worker(mod) -> None:
        wrap(mod.VerifierWorker, "launch", "verify_launch")
        wrap(mod.VerifierWorker, "finish", "verify_finish")

    def logits_processors(mod) -> None:
        wrap(mod, "apply", "verify_logits_apply")

    PATCHES = {
        "specsplit.runtime.grammar": grammar,
        "llguidance.numpy": llguidance_numpy,
        "specsplit.drafter.later_steps": later_steps,
        "specsplit.drafter.runner": runner,
        "specsplit.verifier.worker": worker,
        "specsplit.verifier.logits_processors": logits_processors,
    }

    class Patcher(importlib.abc.MetaPathFinder):
        """Wraps a module's functions right after it is first imported."""

        def find_spec(self, name, path, target=None):
            if name not in PATCHES:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None:
                return None
            loader = spec.loader

            class PatchingLoader(importlib.abc.Loader):
                def create_module(self, s):
                    return loader.create_module(s)

                def exec_module(self, module):
                    loader.exec_module(module)
                    PATCHES[name](module)

            spec.loader = PatchingLoader()
            return spec

    sys.meta_path.insert(0, Patcher())

    def quantile_ms(hist: dict[int, int], count: int, q: float) -> float:
        seen = 0
        for bucket in sorted(hist):
            seen += hist[bucket]
            if seen >= q * count:
                return 2 ** (bucket / 4) / 1e3
        return 0.0

    def dump() -> None:
        with LOCK:
            items = [(k, dict(v, hist=dict(v["hist"]))) for k, v in STATS.items()]
        out = {
            k: {
                "count": v["count"],
                "total_ms": 1e3 * v["total"],
                "median_ms": quantile_ms(v["hist"], v["count"], 0.5),
                "p90_ms": quantile_ms(v["hist"], v["count"], 0.9),
                "max_ms": 1e3 * v["max"],
                "mean_rows": v["rows"] / v["count"],
            }
            for k, v in items
        }
        if out:
            program = os.path.basename(sys.argv[0] or "python")
            with open(os.path.join(os.environ["PROBE_OUT"], f"probe-{os.getpid()}-{program}.json"), "w") as f:
                json.dump(out, f, indent=1)

    atexit.register(dump)
