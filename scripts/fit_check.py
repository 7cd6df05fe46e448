#!/usr/bin/env python3
"""Check `cachalot fit` on a GPU: PyTorch's own allocator, limited to the predicted capacity,
runs each program without running out of memory, and limited to 2 MiB less it does not.

Reads the predictions computed without a GPU (results/fit/predictions.json, written by
scripts/fit_predictions.py: `cachalot fit --limit fraction --json` per fixture and policy).
For each prediction it

  1. exports the program cachalot replayed (`cachalot replay ... --ops-out`, with the
     `cachalot` binary carried to the GPU machine, .gpu/bin/cachalot), and recomputes the
     prediction with that binary (`cachalot fit --limit fraction`) to check it is the
     committed one;
  2. replays the program through PyTorch's C++ caching allocator (scripts/pytorch_replay.py,
     each run a fresh process, PYTORCH_CUDA_ALLOC_CONF as the policy says) with
     `torch.cuda.set_per_process_memory_fraction(f)` set so that the allocator may reserve
     exactly C bytes: f is the smallest double with int(f * total) >= C, total being
     `torch.cuda.mem_get_info()[1]`, as PyTorch computes its cap (allowed_memory_maximum =
     f * total; a new segment is refused when reserved bytes + its size would pass it);
  3. once at C = the prediction (must finish with num_ooms == 0) and once at C - 2 MiB (must
     report at least one out-of-memory error).

Why a fraction, and why the CUDA context does not enter: PyTorch's fraction caps the bytes
its caching allocator reserves (its segments), not the device's used memory. The CUDA
context, cuBLAS/cuDNN and the replayer's own host-mapped flags live outside that cap, so
the fraction tests exactly the figure cachalot predicts for the allocator
(`min_allocator_bytes`); on a real card of T bytes the allocator gets T minus that
context (`cachalot fit`'s reserve, measured by scripts/measure_reserve.py), which this check
does not exercise. Under PyTorch's defaults the fraction's test is the same as a full
device's (a segment that does not fit is refused, the cache released, the request retried);
under expandable segments the fraction is checked against the segment size the request
would need even when fewer pages are mapped, and cachalot's `--limit fraction` models that.

Writes into --out: results.json (every run's figures and each check), results.md (a table),
and the ops files and runs under --work. Exit code 1 when any check fails.

Usage (from the repository root, on the GPU machine):
  python3 scripts/fit_check.py --cachalot .gpu/bin/cachalot \
      --predictions results/fit/predictions.json --work /tmp/fitcheck --out "$OUT/fit_check"
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20
BELOW = 2 * MIB


def fraction_for(capacity, total):
    """The smallest double f with int(f * total) >= capacity (at most 1.0)."""
    if capacity >= total:
        return 1.0
    f = capacity / total
    while int(f * total) < capacity and f < 1.0:
        f = math.nextafter(f, 2.0)
    while f > 0.0 and int(math.nextafter(f, -1.0) * total) >= capacity:
        f = math.nextafter(f, -1.0)
    return min(f, 1.0)


def device_total():
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[1])"],
        capture_output=True, text=True, check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cachalot", default=".gpu/bin/cachalot")
    p.add_argument("--predictions", default="results/fit/predictions.json")
    p.add_argument("--work", default="/tmp/cachalot-fit-check")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--only", nargs="*", help="only these prediction names")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ops_dir = os.path.join(a.work, "ops")
    runs_dir = os.path.join(a.work, "runs")
    os.makedirs(ops_dir, exist_ok=True)
    os.makedirs(runs_dir, exist_ok=True)
    with open(a.predictions) as f:
        preds = json.load(f)["predictions"]
    if a.only:
        preds = [x for x in preds if x["name"] in a.only]
    t0 = time.time()
    total = device_total()
    print(f"device total memory (cudaMemGetInfo): {total:,} B", flush=True)

    # 1. The programs, and the predictions recomputed by the carried binary.
    exported = {}
    for pr in preds:
        ops = os.path.join(ops_dir, pr["fixture"] + ".ops")
        if pr["fixture"] not in exported:
            cmd = [a.cachalot] + pr["ops_args"] + ["--ops-out", ops]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr}")
            exported[pr["fixture"]] = ops
        pr["ops"] = ops
        cmd = [a.cachalot, "fit", pr["snapshot"], "--device", str(pr["device"]), "--policy",
               pr["policy"], "--limit", "fraction", "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        again = json.loads(r.stdout)["policies"][0]["min_allocator_bytes"] if r.returncode == 0 else None
        pr["recomputed_min_allocator_bytes"] = again
        pr["recomputed_equal"] = again == pr["min_allocator_bytes"]
    print(f"exported {len(exported)} programs ({time.time() - t0:.0f} s)", flush=True)

    # 2. The runs: at the prediction and 2 MiB below.
    jobs = []
    for pr in preds:
        for tag, cap in (("at", pr["min_allocator_bytes"]), ("below", pr["min_allocator_bytes"] - BELOW)):
            f = fraction_for(cap, total)
            jobs.append({
                "name": f"{pr['name']}__{tag}",
                "ops": pr["ops"],
                "conf": pr["conf"],
                "fraction": f,
                "config": pr["policy"],
                "snapshot": False,
                "_prediction": pr["name"],
                "_tag": tag,
                "_capacity": cap,
                "_cap_bytes": int(f * total),
            })
    jobs_path = os.path.join(a.work, "jobs.json")
    with open(jobs_path, "w") as fh:
        json.dump(jobs, fh, indent=1)
    cmd = [sys.executable, os.path.join(HERE, "pytorch_replay.py"), "--batch", jobs_path,
           "--out", runs_dir, "--jobs", str(a.jobs), "--timeout", str(a.timeout)]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd)

    # 3. The checks.
    rows = []
    failed = 0
    for pr in preds:
        row = {k: pr[k] for k in ("name", "fixture", "policy", "conf", "start", "min_allocator_bytes",
                                  "unconstrained_peak_reserved_bytes", "recomputed_equal")}
        for job in (j for j in jobs if j["_prediction"] == pr["name"]):
            path = os.path.join(runs_dir, job["name"] + ".json")
            res = None
            if os.path.exists(path):
                with open(path) as fh:
                    res = json.load(fh)
            tag = job["_tag"]
            row[tag] = {
                "capacity_bytes": job["_capacity"],
                "fraction": job["fraction"],
                "pytorch_cap_bytes": job["_cap_bytes"],
                "ran": res is not None,
                "num_ooms": res.get("num_ooms") if res else None,
                "max_memory_reserved": res.get("max_memory_reserved") if res else None,
                "num_alloc_retries": res.get("num_alloc_retries") if res else None,
                "forced_releases": res.get("forced_releases") if res else None,
                "allocator_settings": (res or {}).get("allocator_settings"),
            }
        at, below = row.get("at", {}), row.get("below", {})
        ok_at = bool(at.get("ran")) and at.get("num_ooms") == 0 and \
            (at.get("max_memory_reserved") or 0) <= at["capacity_bytes"]
        ok_below = bool(below.get("ran")) and (below.get("num_ooms") or 0) >= 1
        row["fits_at_prediction"] = ok_at
        row["fails_2mib_below"] = ok_below
        row["pass"] = ok_at and ok_below and bool(pr["recomputed_equal"])
        failed += not row["pass"]
        rows.append(row)

    def text_of(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            return f"({' '.join(cmd[:1])}: {err})"

    machine = text_of(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                       "--format=csv,noheader"])
    torch_v = text_of([sys.executable, "-c",
                       "import torch; print(torch.__version__, torch.version.cuda)"])
    doc = {
        "what": "cachalot fit predictions checked with PyTorch's own allocator under "
        "set_per_process_memory_fraction: fits at the prediction, runs out of memory 2 MiB below",
        "machine": machine,
        "torch": torch_v,
        "device_total_memory": total,
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "passed": len(rows) - failed,
        "failed": failed,
        "rows": rows,
    }
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    lines = [
        "| program | policy | start | predicted capacity | PyTorch at it: OOMs / max reserved | "
        "2 MiB below: OOMs | prediction recomputed on the GPU machine | check |",
        "|---|---|---|---:|---:|---:|:-:|:-:|",
    ]
    for r in rows:
        at, below = r.get("at", {}), r.get("below", {})
        lines.append(
            f"| {r['fixture']} | {r['policy']} | {r['start']} | {r['min_allocator_bytes']:,} | "
            f"{at.get('num_ooms')} / {at.get('max_memory_reserved') or 0:,} | {below.get('num_ooms')} | "
            f"{'same' if r['recomputed_equal'] else 'DIFFERENT'} | {'pass' if r['pass'] else 'FAIL'} |"
        )
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "results.md"), "w") as fh:
        fh.write(f"{machine}; torch {torch_v}; device total {total:,} B; {doc['utc']}\n\n" + md)
    print(md)
    print(f"{len(rows) - failed} passed, {failed} failed ({time.time() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
