#!/usr/bin/env python3
"""The PyTorch side of the side-by-side GPU benchmark (docs/GPU_BENCH.md, issue 15).

Runs `cachalot ops v1` files through PyTorch's C++ caching allocator, with the extension of
scripts/pytorch_replay.py (one build, the same replayer), and writes `cachalot gpu-bench v1`
results for the allocators `pytorch` (PyTorch's defaults) and `pytorch-expandable`
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).

For each ops file and configuration, each in a fresh process:

  observed pass  the start's lines (before `s`) unobserved, then the trace's lines with
                 getDeviceStats() read in C++ after every line: the timeline (at most 1000
                 points, each its bucket's maximum; point `line` = sample index, sample i the
                 state after i lines), peak requested/reserved/allocated, reserved_changes,
                 cache_hits. driver_calls: under defaults num_device_alloc + num_device_free;
                 under expandable segments the segment events (segment_alloc, segment_free,
                 segment_map, segment_unmap) of PyTorch's memory history, recorded over the
                 observed lines only (both are in driver_calls_detail under both settings)
  timed pass     scripts/pytorch_replay.py's timing: the first pass over the trace's lines,
                 then passes 2..N (steady state, mean), the side-stream mechanism's time
                 subtracted; ns per operation line

and per configuration one hot loop (a fresh process): 1 MiB raw_alloc_with_stream + raw_delete
pairs in 1, 2, 4 and 8 std::threads, each on its own stream, after a warm-up, started at a
barrier; the wall time until the last thread ends.

Writes OUT/runs/ALLOCATOR__TRACE.json (TRACE: the ops file's name without `.ops`),
OUT/runs/ALLOCATOR__hot__raw.json, OUT/machine_pytorch.json (versions, GPU) and, per process,
its raw figures and log under OUT/pytorch_work/. A failing job writes its error into its JSON
("error") and the batch goes on; the exit status is 1 if any failed.

Usage:
  python3 scripts/pytorch_bench.py --out OUT [--passes N] [--jobs J] [--hot-pairs N]
                                   [--no-hot] [--configs pytorch,pytorch-expandable]
                                   [--timeout S] OPS...

--jobs J runs J observed passes at once (they are not timed); timed passes and hot loops run
one at a time.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pytorch_replay as R  # noqa: E402  (the extension and its build)

SCHEMA = "cachalot gpu-bench v1"
CONFIGS = {"pytorch": None, "pytorch-expandable": "expandable_segments:True"}
MAX_POINTS = 1000
HOT_SIZE = 1 << 20
HOT_THREADS = [1, 2, 4, 8]
HOT_WARMUP = 1000  # pairs per thread before the barrier
SEGMENT_ACTIONS = ["segment_alloc", "segment_free", "segment_map", "segment_unmap"]
SKIP_ACTIONS = ["alloc", "free_requested", "free_completed"]  # only segment events are needed


def trace_name(path):
    base = os.path.basename(path)
    return base[: -len(".ops")] if base.endswith(".ops") else base


# ---- workers (each in a fresh process) ----

def start_history(torch, max_entries):
    """Starts PyTorch's memory history (segment events only where this PyTorch can skip)."""
    kwargs = {"context": None, "stacks": "python", "max_entries": max_entries}
    try:
        torch.cuda.memory._record_memory_history(enabled="all", skip_actions=SKIP_ACTIONS,
                                                 **kwargs)
        return True
    except (TypeError, RuntimeError, ValueError):
        torch.cuda.memory._record_memory_history(enabled="all", **kwargs)
        return False


def work_observed(job):
    import torch

    ext = R.build()
    torch.cuda.init()
    info = ext.prepare(job["ops"])
    ext.run_start()
    device = torch.cuda.current_device()
    lines = int(info["trace_lines"])
    max_entries = 4 * lines + 100_000
    history = {"skipped_non_segment_actions": start_history(torch, max_entries)}
    obs = ext.run_observed(MAX_POINTS)
    # No synchronisation: a side stream whose free the trace never completed still spins.
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces") or []
    entries = traces[device] if device < len(traces) else []
    counts = Counter(e.get("action") for e in entries)
    history["counts"] = {a: counts.get(a, 0) for a in SEGMENT_ACTIONS}
    history["entries"] = len(entries)
    history["overflowed"] = len(entries) >= max_entries
    segs = snap.get("segments") or []
    counters = ext.counters()
    ext.finish()
    out = {k: v[0] for k, v in obs.items() if not k.startswith("t_")}
    out["timeline"] = {k[2:]: v for k, v in obs.items() if k.startswith("t_")}
    out.update({
        "start_lines": int(info["start_lines"]),
        "history": history,
        "segments_at_end": len(segs),
        "expandable_segments_at_end": sum(1 for s in segs if s.get("is_expandable")),
        "allocator_settings": snap.get("allocator_settings"),
        "forced_releases": int(counters["forced_releases"]),
        "skipped_lines": int(counters["skipped_lines"]),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
    })
    return out


def work_timed(job):
    import torch

    ext = R.build()
    torch.cuda.init()
    info = ext.prepare(job["ops"])
    ext.run_start()
    first = ext.run_pass(True, False)
    ext.release_all()
    # Each steady pass times the lines only; the frees of what is left live (and the side
    # streams' completion) come after it, untimed, as in gpu_compare.
    steady = []
    for _ in range(1, job["passes"]):
        steady.append(ext.run_pass(False, False))
        ext.release_all()
    counters = ext.counters()
    ext.finish()
    return {
        "lines": int(info["trace_lines"]),
        "first_ns": first,
        "steady_ns": steady,
        "forced_releases": int(counters["forced_releases"]),
    }


def work_hot(job):
    import torch

    ext = R.build()
    torch.cuda.init()
    walls = []
    for threads, per_thread in zip(job["threads"], job["pairs_per_thread"]):
        walls.append(ext.hot_loop(job["size"], threads, per_thread, job["warmup"]))
    return {"wall_ns": walls}


def work_env(job):
    import platform

    import torch

    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "gpu_name": torch.cuda.get_device_name(0),
        "gpu_total_memory": int(props.total_memory),
        "driver_version": R.driver_version(),
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


WORKERS = {"observed": work_observed, "timed": work_timed, "hot": work_hot, "env": work_env}


# ---- the driver ----

def spawn(kind, job, conf, out_path, timeout):
    """Runs worker `kind` in a fresh process under `conf`; returns (figures, error)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, json.dumps(job), out_path]
    if os.path.exists(out_path):
        os.remove(out_path)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"{kind}: timed out after {timeout} s"
    with open(out_path + ".log", "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        text = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        last = text[-1].strip() if text else "(no output)"
        return None, f"{kind}: exit code {proc.returncode}: {last} (log: {out_path}.log)"
    try:
        with open(out_path) as f:
            return json.load(f), None
    except (OSError, ValueError) as err:
        return None, f"{kind}: no figures: {err}"


def rnd(x, digits):
    return None if x is None else round(x, digits)


def history_text(h):
    c = h["counts"]
    return (f"memory history: segment_alloc {c['segment_alloc']}, segment_free "
            f"{c['segment_free']}, segment_map {c['segment_map']}, segment_unmap "
            f"{c['segment_unmap']}")


def trace_run(allocator, conf, obs, timed, passes):
    """The `cachalot gpu-bench v1` trace object from one observed and one timed pass."""
    lines = obs["lines"]
    allocs = obs["allocs"]
    h = obs["history"]
    notes = [f"PyTorch {obs['torch_version']} (CUDA {obs['cuda_version']}), "
             f"PYTORCH_CUDA_ALLOC_CONF={conf or 'unset'}"]
    dev = f"num_device_alloc {obs['device_allocs']}, num_device_free {obs['device_frees']}"
    if conf is None:
        driver_calls = obs["device_allocs"] + obs["device_frees"]
        detail = f"device allocs {obs['device_allocs']}, frees {obs['device_frees']} " \
                 f"(PyTorch's num_device_alloc/num_device_free); cross-check: {history_text(h)}"
    elif h["overflowed"]:
        driver_calls = None
        detail = f"memory history overflowed ({h['entries']} entries); {dev}"
    else:
        driver_calls = sum(h["counts"].values())
        detail = (f"{history_text(h)} (one map/unmap event can cover several pages); "
                  f"PyTorch's own counters: {dev}")
    if conf and obs["expandable_segments_at_end"] == 0 and obs["segments_at_end"] > 0:
        notes.append("expandable segments were asked for, but no segment at the end is "
                     "expandable")
    if obs["start_lines"]:
        notes.append(f"the start's {obs['start_lines']} lines (before `s`) ran first, "
                     "unobserved and untimed: timeline point 0 is the state after them")
    if obs["stats_peak_reserved"] != obs["peak_reserved"]:
        notes.append("PyTorch's own peak reserved (start and mid-operation included): "
                     f"{obs['stats_peak_reserved']}")
    forced = obs["forced_releases"] + (timed["forced_releases"] if timed else 0)
    if forced:
        notes.append(f"{forced} forced side-stream releases (PyTorch waited for an event: "
                     "see scripts/pytorch_replay.py's watchdog)")
    if obs["skipped_lines"]:
        notes.append(f"{obs['skipped_lines']} lines named a handle whose allocation failed")
    notes.append("the side-stream mechanism's time is subtracted; each pass times its lines "
                 "only (what is left live is freed after it, untimed)")
    steady = timed["steady_ns"]
    per_line = (lambda ns: ns / lines) if lines else (lambda ns: None)
    return {
        "schema": SCHEMA,
        "kind": "trace",
        "allocator": allocator,
        "trace": None,  # set by the caller
        "lines": lines,
        "total_lines": lines,
        "allocs": allocs,
        "ooms": obs["ooms"],
        "peak_requested": obs["peak_requested"],
        "peak_reserved": obs["peak_reserved"],
        "peak_allocated": obs["peak_allocated"],
        "ratio": rnd(obs["peak_reserved"] / obs["peak_requested"], 6)
        if obs["peak_requested"] else None,
        "driver_calls": driver_calls,
        "driver_calls_detail": detail,
        "reserved_changes": obs["reserved_changes"],
        "cache_hits": obs["cache_hits"],
        "hit_rate": rnd(obs["cache_hits"] / allocs, 6) if allocs else None,
        "passes": passes,
        "ns_per_op_first": rnd(per_line(timed["first_ns"]), 2),
        "ns_per_op_steady": rnd(per_line(sum(steady) / len(steady)), 2) if steady else None,
        "steady_passes_ns_per_op": [rnd(per_line(s), 2) for s in steady] if steady else None,
        "timeline": {
            "line": obs["timeline"]["line"],
            "requested": obs["timeline"]["requested"],
            "reserved": obs["timeline"]["reserved"],
        },
        "notes": "; ".join(notes),
    }


def hot_run(allocator, figures, job):
    threads, per = job["threads"], job["pairs_per_thread"]
    walls = figures["wall_ns"]
    return {
        "schema": SCHEMA,
        "kind": "hot_loop",
        "allocator": allocator,
        "path": "raw",
        "size": job["size"],
        "threads": threads,
        "pairs_per_thread": per,
        "wall_ns_per_pair": [rnd(w / (p * t), 3) for w, p, t in zip(walls, per, threads)],
        "ns_per_pair_per_thread": [rnd(w / p, 3) for w, p in zip(walls, per)],
    }


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def check_ops(path):
    """A clear error for a file that is not a readable `cachalot ops v1` file, else None."""
    try:
        with open(path) as f:
            first = f.readline().rstrip("\n")
    except OSError as err:
        return f"cannot read {path}: {err}"
    if first != "# cachalot ops v1":
        return f"{path}: not a `cachalot ops v1` file (first line {first[:60]!r})"
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*", help="ops files from `cachalot replay --ops-out`")
    p.add_argument("--out", help="the results folder (OUT/runs/ receives the JSON files)")
    p.add_argument("--passes", type=int, default=5,
                   help="timed passes: the first, then passes-1 steady ones (default 5)")
    p.add_argument("--jobs", type=int, default=1, help="observed passes run at once")
    p.add_argument("--hot-pairs", type=int, default=1_000_000,
                   help="hot-loop pairs per configuration and thread count, spread over the "
                   "threads (default 1000000)")
    p.add_argument("--no-hot", action="store_true", help="skip the hot loops")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    p.add_argument("--worker", nargs=3, metavar=("KIND", "JOB", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.worker:
        kind, job, out = a.worker
        figures = WORKERS[kind](json.loads(job))
        write_json(out, figures)
        return 0

    if not a.out:
        p.error("--out is required")
    if a.passes < 1 or a.jobs < 1 or a.hot_pairs < 1 or a.timeout <= 0:
        p.error("--passes, --jobs, --hot-pairs and --timeout must be positive")
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        p.error(f"--configs: unknown {unknown} (known: {', '.join(CONFIGS)})")
    if not a.ops and a.no_hot:
        p.error("nothing to do: no ops files and --no-hot")
    names = [trace_name(o) for o in a.ops]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        p.error(f"two ops files share the trace name(s) {dupes}")

    runs = os.path.join(a.out, "runs")
    work = os.path.join(a.out, "pytorch_work")
    os.makedirs(runs, exist_ok=True)
    os.makedirs(work, exist_ok=True)

    t0 = time.time()
    try:
        ext = R.build(verbose=False)
    except Exception as err:  # no torch, no compiler, no CUDA toolkit: nothing can run
        print(f"cannot build the replay extension: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    os.environ["CACHALOT_PYTORCH_REPLAY_EXT"] = ext.__file__
    print(f"extension ready in {time.time() - t0:.1f} s: {ext.__file__}", flush=True)

    env, err = spawn("env", {}, None, os.path.join(work, "env.json"), a.timeout)
    machine = env if env else {"error": err}
    try:
        machine["cachalot_commit"] = subprocess.run(
            ["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True,
            timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        machine["cachalot_commit"] = None
    write_json(os.path.join(a.out, "machine_pytorch.json"), machine)
    print(f"machine: {json.dumps(machine)}", flush=True)

    failed = 0
    jobs = [(c, o, n) for o, n in zip(a.ops, names) for c in configs]
    observed = {}

    def observe(item):
        config, ops, name = item
        problem = check_ops(ops)
        if problem:
            return item, None, problem
        path = os.path.join(work, f"{config}__{name}.observed.json")
        fig, err = spawn("observed", {"ops": os.path.abspath(ops)}, CONFIGS[config], path,
                         a.timeout)
        return item, fig, err

    t = time.time()
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for item, fig, err in pool.map(observe, jobs):
            observed[item] = (fig, err)
            print(f"observed {item[0]:20} {item[2]:32} "
                  f"{'ok' if fig else 'FAILED: ' + err} ({time.time() - t:.0f} s)", flush=True)

    for item in jobs:
        config, ops, name = item
        obs, err = observed[item]
        timed = None
        if obs is not None:
            path = os.path.join(work, f"{config}__{name}.timed.json")
            timed, err = spawn("timed", {"ops": os.path.abspath(ops), "passes": a.passes},
                               CONFIGS[config], path, a.timeout)
            if timed is not None and timed["lines"] != obs["lines"]:
                timed, err = None, f"timed pass ran {timed['lines']} lines, observed {obs['lines']}"
        out = os.path.join(runs, f"{config}__{name}.json")
        if obs is None or timed is None:
            failed += 1
            write_json(out, {"schema": SCHEMA, "kind": "trace", "allocator": config,
                             "trace": name, "error": err})
            print(f"{config:20} {name:32} FAILED: {err}", flush=True)
            continue
        run = trace_run(config, CONFIGS[config], obs, timed, a.passes)
        run["trace"] = name
        write_json(out, run)
        print(f"{config:20} {name:32} reserved {run['peak_reserved']:>13} ratio "
              f"{run['ratio']} driver {run['driver_calls']} hits {run['hit_rate']} ns/line "
              f"{run['ns_per_op_first']}/{run['ns_per_op_steady']}", flush=True)

    if not a.no_hot:
        per = [max(1, a.hot_pairs // t) for t in HOT_THREADS]
        job = {"size": HOT_SIZE, "threads": HOT_THREADS, "pairs_per_thread": per,
               "warmup": HOT_WARMUP}
        for config in configs:
            path = os.path.join(work, f"{config}__hot__raw.json")
            fig, err = spawn("hot", job, CONFIGS[config], path, a.timeout)
            out = os.path.join(runs, f"{config}__hot__raw.json")
            if fig is None:
                failed += 1
                write_json(out, {"schema": SCHEMA, "kind": "hot_loop", "allocator": config,
                                 "path": "raw", "error": err})
                print(f"{config:20} hot loop FAILED: {err}", flush=True)
                continue
            run = hot_run(config, fig, job)
            write_json(out, run)
            print(f"{config:20} hot loop ns/pair per thread {run['ns_per_pair_per_thread']}",
                  flush=True)

    total = len(jobs) + (0 if a.no_hot else len(configs))
    print(f"{total - failed} ok, {failed} failed ({time.time() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
