#!/usr/bin/env python3
"""Compute the `cachalot fit` predictions that scripts/fit_check.py verifies on a GPU.

For each fixture and policy below this runs, on a machine with Rust (no GPU needed),

  cachalot fit SNAPSHOT [--device D] --policy POLICY --limit fraction --json

(the smallest capacity PyTorch's allocator may reserve, found with the limit modelled as
`torch.cuda.set_per_process_memory_fraction` on the trace's H200: the limit the GPU check
sets) and writes one JSON file:

  {"made_with": ..., "predictions": [{"name", "snapshot", "device", "policy", "conf",
    "start", "min_allocator_bytes", "unconstrained_peak_reserved_bytes",
    "ops_args": [...]}, ...]}

`ops_args` are the arguments of `cachalot replay` that export the same program
(`--ops-out`), which scripts/fit_check.py runs with the `cachalot` binary carried to the GPU
machine (.gpu/bin/cachalot).

Usage:
  python3 scripts/fit_predictions.py --cachalot target/release/cachalot \
      --out results/fit/predictions.json [--fixtures NAME=SNAPSHOT ...]
"""

import argparse
import json
import os
import subprocess
import sys
import time

# (name, snapshot, device): fresh traces recorded with PyTorch's defaults (no memory fraction)
# and two user-style snapshots recorded mid-run (replayed from their live tensors).
FIXTURES = [
    ("resnet18_train", "tests/fixtures/traces/resnet18_train.pickle", None),
    ("gpt2_train", "tests/fixtures/traces/gpt2_train.pickle", None),
    ("bert_infer", "tests/fixtures/traces/bert_infer.pickle", None),
    ("gpt2_generate", "tests/fixtures/traces/gpt2_generate.pickle", None),
    ("two_stream", "tests/fixtures/traces/two_stream.pickle", None),
    ("empty_cache_loop", "tests/fixtures/traces/empty_cache_loop.pickle", None),
    ("unet_wrapped", "tests/fixtures/user/unet_wrapped.pickle.gz", None),
    ("resnet50_warm", "tests/fixtures/user/resnet50_warm.pickle.gz", None),
]

# policy name -> PYTORCH_CUDA_ALLOC_CONF for PyTorch's own allocator on the GPU.
POLICIES = {"pytorch": None, "expandable": "expandable_segments:True"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cachalot", required=True, help="the cachalot binary")
    p.add_argument("--out", required=True, help="the predictions file to write")
    p.add_argument("--fixtures", nargs="*", metavar="NAME=SNAPSHOT",
                   help="these snapshots instead of the committed fixtures (device 0)")
    a = p.parse_args()
    fixtures = FIXTURES
    if a.fixtures:
        fixtures = [(f.split("=", 1)[0], f.split("=", 1)[1], None) for f in a.fixtures]
    preds = []
    for name, snap, device in fixtures:
        for policy, conf in POLICIES.items():
            cmd = [a.cachalot, "fit", snap, "--policy", policy, "--limit", "fraction", "--json"]
            if device is not None:
                cmd += ["--device", str(device)]
            t = time.time()
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr}")
            r = json.loads(out.stdout)
            row = r["policies"][0]
            ops_args = ["replay", snap, "--pytorch", "--json"]
            if device is not None:
                ops_args += ["--device", str(device)]
            if r["start"] == "live_tensors":
                ops_args += ["--start", "live-tensors"]
            preds.append(
                {
                    "name": f"{name}__{policy}",
                    "fixture": name,
                    "snapshot": snap,
                    "device": r["device"],
                    "policy": policy,
                    "conf": conf,
                    "start": r["start"],
                    "min_allocator_bytes": row["min_allocator_bytes"],
                    "fraction_on_prediction_device": row.get("fraction"),
                    "prediction_device_bytes": row.get("fraction_device_bytes"),
                    "unconstrained_peak_reserved_bytes": row["unconstrained_peak_reserved_bytes"],
                    "ooms_one_step_below": row["ooms_one_step_below"],
                    "replays": row["replays"],
                    "ops_args": ops_args,
                }
            )
            print(f"{name:18} {policy:11} {row['min_allocator_bytes']:>14,} B "
                  f"(no limit: {row['unconstrained_peak_reserved_bytes']:,}) "
                  f"{time.time() - t:.1f} s", flush=True)
    doc = {
        "what": "cachalot fit predictions (--limit fraction): the smallest capacity PyTorch's "
        "caching allocator may reserve for each program, verified on a GPU by "
        "scripts/fit_check.py",
        "made_with": " ".join([os.path.basename(a.cachalot), "fit", "... --limit fraction --json"]),
        "made_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "granularity_bytes": 2 << 20,
        "predictions": preds,
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {len(preds)} predictions to {a.out}")


if __name__ == "__main__":
    main()
