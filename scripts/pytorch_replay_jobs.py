#!/usr/bin/env python3
"""Export cachalot ops files for snapshot fixtures and list the PyTorch replays to run on them.

For every (snapshot, device) given, this runs (no GPU needed)

  cachalot replay SNAPSHOT --device D --start live-tensors --ops-out OUT/ops/NAME.ops --json
                  [--pytorch]

and writes into OUT:

  ops/NAME.ops     the program cachalot replays (a mid-run recording from its live tensors)
  cachalot/NAME.json  cachalot's own report of that replay (under the trace's recorded
                   settings with --pytorch; under cachalot's defaults when cachalot cannot
                   use the recorded settings, e.g. expandable_segments:True)
  manifest.json    per trace: the snapshot, device, recorded settings and PyTorch's recorded
                   figures (from the NAME.json sidecar), cachalot's figures
  jobs.json        the replays for scripts/pytorch_replay.py --batch: each trace under
                   `default` (PyTorch's defaults), `expandable` (expandable_segments:True) and,
                   when the trace was recorded under other settings, `recorded` (its own
                   PYTORCH_CUDA_ALLOC_CONF and memory fraction) and `recorded+expandable`

Usage:
  python3 scripts/pytorch_replay_jobs.py --cachalot target/release/cachalot --out DIR \
      [--snapshot-configs expandable] SNAPSHOT[@DEVICE] ...

A snapshot without @DEVICE is taken for every device whose trace has entries (read from its
sidecar's per-device figures when it has them, else device 0). Derived fixtures
(tests/fixtures/derived/NAME.protoP.pickle) take their figures from
tests/fixtures/traces/NAME.json.
"""

import argparse
import json
import os
import subprocess
import sys

EXPANDABLE = "expandable_segments:True"


def sidecar(path):
    base = path[:-3] if path.endswith(".gz") else path
    side = os.path.splitext(base)[0] + ".json"
    if os.path.exists(side):
        return side
    # derived/NAME.protoP.pickle -> traces/NAME.json
    name = os.path.basename(os.path.splitext(base)[0])
    if ".proto" in name and os.sep + "derived" + os.sep in os.path.abspath(path):
        stem = name.split(".proto")[0]
        cand = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))),
                            "traces", stem + ".json")
        if os.path.exists(cand):
            return cand
    return None


def recorded(fig, device):
    """PyTorch's recorded figures for `device` from a sidecar (both sidecar formats)."""
    if fig is None:
        return None
    d = fig
    if "devices" in fig:
        d = next((x for x in fig["devices"] if x.get("device") == device), None)
        if d is None:
            return None
    stats = d.get("memory_stats", {})
    return {
        "max_memory_reserved": d.get("max_memory_reserved"),
        "max_memory_allocated": d.get("max_memory_allocated"),
        "num_device_alloc": stats.get("num_device_alloc"),
        "num_device_free": stats.get("num_device_free"),
        "peak_segments": stats.get("segment.all.peak"),
        "num_ooms": stats.get("num_ooms"),
        "recorded_from_process_start": "stats_at_start" not in fig and "reset_after" not in fig,
        "peaks_reset_inside_trace": "reset_after" in fig,
    }


def devices_of(fig):
    if fig and "devices" in fig:
        counts = fig.get("trace_entries_per_device") or []
        return [d["device"] for d in fig["devices"]
                if d["device"] < len(counts) and counts[d["device"]] > 1]
    return [0]


def run_cachalot(cachalot, snap, device, ops_path):
    base = [cachalot, "replay", snap, "--device", str(device), "--start", "live-tensors",
            "--ops-out", ops_path, "--json"]
    proc = subprocess.run(base + ["--pytorch"], capture_output=True, text=True)
    settings = "recorded"
    if proc.returncode == 2 and any(
        m in proc.stderr for m in ("not usable", "cannot be used", "unsupported setting")
    ):
        proc = subprocess.run(base, capture_output=True, text=True)
        settings = "cachalot defaults (the recorded settings are not usable by cachalot)"
    if proc.returncode != 0:
        raise RuntimeError(f"cachalot failed on {snap} device {device}: {proc.stderr.strip()}")
    return json.loads(proc.stdout), settings


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cachalot", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--snapshot-configs", default="",
                   help="comma-separated configs whose replays dump a snapshot")
    p.add_argument("--relative-to", default=None,
                   help="write ops paths in jobs.json relative to this folder")
    p.add_argument("--no-jobs-for", default="",
                   help="comma-separated name prefixes to export without replay jobs "
                   "(e.g. derived__: the same operations as their traces)")
    p.add_argument("--snapshot-only-for", default="",
                   help="comma-separated name prefixes whose snapshot configs dump snapshots "
                   "(default: all)")
    p.add_argument("snapshots", nargs="+")
    a = p.parse_args()
    os.makedirs(os.path.join(a.out, "ops"), exist_ok=True)
    os.makedirs(os.path.join(a.out, "cachalot"), exist_ok=True)
    snap_configs = {c for c in a.snapshot_configs.split(",") if c}

    manifest, jobs = [], []
    for spec in a.snapshots:
        snap, _, dev = spec.partition("@")
        side = sidecar(snap)
        fig = json.load(open(side)) if side else None
        devices = [int(dev)] if dev else devices_of(fig)
        base = os.path.basename(snap)
        for suffix in (".gz", ".pickle"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
        group = os.path.basename(os.path.dirname(os.path.abspath(snap)))
        for d in devices:
            name = f"{group}__{base}" + (f"__dev{d}" if len(devices) > 1 or d else "")
            ops = os.path.join(a.out, "ops", name + ".ops")
            try:
                report, cachalot_settings = run_cachalot(a.cachalot, snap, d, ops)
            except RuntimeError as err:
                print(f"{name}: skipped: {err}", flush=True)
                continue
            with open(os.path.join(a.out, "cachalot", name + ".json"), "w") as f:
                json.dump(report, f, indent=1, sort_keys=True)
            conf = None
            fraction = None
            if fig:
                conf = fig.get("pytorch_cuda_alloc_conf") or None
                fraction = fig.get("memory_fraction")
            header = {}
            with open(ops) as f:
                for line in f:
                    if not line.startswith("#"):
                        break
                    if ": " in line:
                        k, v = line[2:].rstrip("\n").split(": ", 1)
                        header[k] = v
            entry = {
                "name": name,
                "snapshot": snap,
                "device": d,
                "sidecar": side,
                "recorded_conf": conf,
                "recorded_memory_fraction": fraction,
                "ops_header": header,
                "recorded": recorded(fig, d),
                "cachalot": {k: report.get(k) for k in (
                    "peak_reserved_bytes", "peak_allocated_bytes", "peak_requested_bytes",
                    "device_allocs", "device_frees", "peak_segments", "ooms", "ns_per_op",
                    "config", "start")},
                "cachalot_settings": cachalot_settings,
            }
            manifest.append(entry)
            ops_ref = os.path.relpath(ops, a.relative_to) if a.relative_to else ops
            configs = [("default", None, None), ("expandable", EXPANDABLE, None)]
            own = bool(conf) or fraction is not None
            if own and (conf != EXPANDABLE or fraction is not None):
                configs.append(("recorded", conf, fraction))
                if EXPANDABLE not in (conf or ""):
                    both = ",".join(c for c in (conf, EXPANDABLE) if c)
                    configs.append(("recorded+expandable", both, fraction))
            skip = [x for x in a.no_jobs_for.split(",") if x]
            if any(name.startswith(x) for x in skip):
                configs = []
            snap_for = [x for x in a.snapshot_only_for.split(",") if x]
            snapshots_here = not snap_for or any(name.startswith(x) for x in snap_for)
            for cname, cconf, cfrac in configs:
                jobs.append({
                    "name": f"{name}__{cname.replace('+', '_')}",
                    "trace": name,
                    "ops": ops_ref,
                    "conf": cconf,
                    "fraction": cfrac,
                    "config": cname,
                    "snapshot": snapshots_here and cname in snap_configs,
                })
            print(f"{name}: {header.get('allocs')} allocs, start {header.get('start')}, "
                  f"cachalot peak reserved {report.get('peak_reserved_bytes')}", flush=True)
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    with open(os.path.join(a.out, "jobs.json"), "w") as f:
        json.dump(jobs, f, indent=1)
    print(f"{len(manifest)} traces, {len(jobs)} replays")
    return 0


if __name__ == "__main__":
    sys.exit(main())
