#!/usr/bin/env python3
"""Gather PyTorch-replay runs into results.json, results.csv and a Markdown table.

  python3 scripts/pytorch_replay_report.py --out DIR \
      --set MANIFEST.json RUNS_DIR [--set MANIFEST.json RUNS_DIR ...]

MANIFEST.json comes from scripts/pytorch_replay_jobs.py, RUNS_DIR from
scripts/pytorch_replay.py --batch. Each trace row gets: PyTorch's recorded peaks (from the
fixture's sidecar), cachalot's replay of the same program, and PyTorch's replay under each
configuration, with whether the replay under the trace's own configuration reproduces the
recorded max_memory_reserved.
"""

import argparse
import csv
import json
import os
import sys

CONFIGS = ["recorded", "default", "expandable", "recorded+expandable"]


def load_set(manifest_path, runs_dir):
    manifest = json.load(open(manifest_path))
    runs = {}
    for f in os.listdir(runs_dir):
        if f.endswith(".json") and f != "index.json":
            r = json.load(open(os.path.join(runs_dir, f)))
            runs[(r["name"].rsplit("__", 1)[0], r["config"])] = r
    return manifest, runs


def mib(x):
    return "–" if x is None else f"{x / 2**20:,.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--set", nargs=2, action="append", metavar=("MANIFEST", "RUNS"), required=True)
    p.add_argument("--title", default="PyTorch's caching allocator on cachalot's replay programs")
    p.add_argument("--machine", help="machine.txt from the GPU run")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    rows, runs_out = [], []
    for manifest_path, runs_dir in a.set:
        manifest, runs = load_set(manifest_path, runs_dir)
        entries = {m["name"]: m for m in manifest}
        for m in manifest:
            name = m["name"]
            alias = None
            if not any(k[0] == name for k in runs) and name.startswith("derived__"):
                # Derived fixtures are the same operations as their traces (checked on export).
                alias = "traces__" + name[len("derived__"):].split(".proto")[0]
            src = alias or name
            rec = m.get("recorded") or {}
            # cachalot reads no sidecar beside a derived fixture (no memory fraction): its
            # figures for the same operations are those of the trace it was derived from.
            cm = entries[alias] if alias in entries else m
            row = {
                "trace": name,
                "snapshot": m["snapshot"],
                "device": m["device"],
                "start": m["ops_header"].get("start"),
                "allocs": int(m["ops_header"].get("allocs", 0)),
                "recorded_conf": m.get("recorded_conf"),
                "recorded_memory_fraction": m.get("recorded_memory_fraction"),
                "same_operations_as": alias,
                "recorded_max_memory_reserved": rec.get("max_memory_reserved"),
                "recorded_max_memory_allocated": rec.get("max_memory_allocated"),
                "recorded_from_process_start": rec.get("recorded_from_process_start"),
                "cachalot_settings": cm.get("cachalot_settings"),
                "cachalot_peak_reserved": cm["cachalot"].get("peak_reserved_bytes"),
                "cachalot_peak_allocated": cm["cachalot"].get("peak_allocated_bytes"),
                "peak_requested": cm["cachalot"].get("peak_requested_bytes"),
            }
            for c in CONFIGS:
                r = runs.get((src, c))
                if r is None:
                    continue
                key = c.replace("+", "_")
                row[f"pytorch_{key}_max_reserved"] = r["max_memory_reserved"]
                row[f"pytorch_{key}_max_allocated"] = r["max_memory_allocated"]
                row[f"pytorch_{key}_device_allocs"] = r["num_device_alloc"]
                row[f"pytorch_{key}_device_frees"] = r["num_device_free"]
                row[f"pytorch_{key}_ns_per_op_first"] = round(r["ns_per_op_first"], 1)
                row[f"pytorch_{key}_ns_per_op_steady"] = (
                    round(r["ns_per_op_steady"], 1) if r["ns_per_op_steady"] else None)
                row[f"pytorch_{key}_forced_releases"] = r["forced_releases"]
                if alias is None:
                    runs_out.append(r)
            # The replay under the trace's own configuration.
            own = "recorded" if (src, "recorded") in runs else (
                "expandable" if (m.get("recorded_conf") or "") == "expandable_segments:True"
                else "default")
            row["own_config"] = own
            ownr = runs.get((src, own))
            row["pytorch_own_max_reserved"] = ownr["max_memory_reserved"] if ownr else None
            # Comparable when the recording began with the process (its peaks then cover the
            # whole trace, and the replay starts, as the process did, from nothing).
            fresh = bool(rec.get("recorded_from_process_start"))
            if ownr and rec.get("max_memory_reserved") is not None and fresh:
                row["reproduces_recorded_reserved"] = (
                    ownr["max_memory_reserved"] == rec["max_memory_reserved"])
            else:
                row["reproduces_recorded_reserved"] = None
            if ownr and row["cachalot_settings"] == "recorded":
                row["cachalot_equals_pytorch_replay"] = (
                    row["cachalot_peak_reserved"] == ownr["max_memory_reserved"])
            else:
                row["cachalot_equals_pytorch_replay"] = None
            rows.append(row)

    with open(os.path.join(a.out, "results.json"), "w") as f:
        f.write("{\n\"rows\": [\n")
        f.write(",\n".join(json.dumps(r, sort_keys=True) for r in rows))
        f.write("\n],\n\"runs\": [\n")
        f.write(",\n".join(json.dumps(r, sort_keys=True) for r in runs_out))
        f.write("\n]\n}\n")
    keys = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)

    lines = []
    lines.append("| trace | recorded settings | recorded peak reserved | cachalot, same program "
                 "| PyTorch replay, own settings | own = recorded? | PyTorch replay, defaults "
                 "| PyTorch replay, expandable | expandable / defaults | peak requested "
                 "| ns/op defaults (first / steady) | ns/op expandable (first / steady) |")
    lines.append("|---|---|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        conf = r["recorded_conf"] or "–"
        if r["recorded_memory_fraction"] is not None:
            conf += f" + fraction {r['recorded_memory_fraction']:.6f}"
        name = r["trace"].replace("__", "/")
        if r["same_operations_as"]:
            name += f" (ops = {r['same_operations_as'].replace('__', '/')})"
        ok = {True: "yes", False: "**no**", None: "n/a"}[r["reproduces_recorded_reserved"]]
        d = r.get("pytorch_default_max_reserved")
        e = r.get("pytorch_expandable_max_reserved")
        ratio = f"{e / d:.3f}" if d and e else "–"
        cach = r["cachalot_peak_reserved"]
        cach_s = f"{cach:,}" if cach is not None else "–"
        if r["cachalot_settings"] != "recorded":
            cach_s += " (cachalot's defaults)"
        def ns(k):
            f = r.get(f"pytorch_{k}_ns_per_op_first")
            s = r.get(f"pytorch_{k}_ns_per_op_steady")
            return "–" if f is None else f"{f:,.0f} / {s:,.0f}" if s else f"{f:,.0f}"
        rr = r["recorded_max_memory_reserved"]
        lines.append(
            f"| {name} | {conf} | {rr:,} | {cach_s} | {r['pytorch_own_max_reserved']:,} | {ok} "
            f"| {d:,} | {e:,} | {ratio} | {r['peak_requested']:,} | {ns('default')} "
            f"| {ns('expandable')} |"
            if rr is not None and d is not None and e is not None and r["pytorch_own_max_reserved"]
            is not None else
            f"| {name} | {conf} | {rr if rr is None else format(rr, ',')} | {cach_s} "
            f"| {r['pytorch_own_max_reserved']} | {ok} | {d} | {e} | {ratio} "
            f"| {r['peak_requested']} | {ns('default')} | {ns('expandable')} |"
        )
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
