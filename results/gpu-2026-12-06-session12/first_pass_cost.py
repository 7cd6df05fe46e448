#!/usr/bin/env python3
"""Where the default policy's first pass goes on the GPU: its driver work counted on the
simulated device, priced per page against the GPU's measured first passes.

    first_pass_cost.py SIM_RUNS GPU_RUNS

SIM_RUNS: `gpu_compare --backend sim --passes 1 --no-hot --only cachalot,cachalot-pytorch`'s
runs/ over the same ops files (its detail names handles made, pages mapped again, pages
unmapped); GPU_RUNS: the side-by-side benchmark's runs/. Model: the default's first pass =
cachalot-with-PyTorch's-policy's first pass on the same GPU (the program and the policy's own
work) + a·handles + b·pages mapped again + c·pages unmapped, a, b, c fitted by least squares
on relative error. Needs numpy."""
import json, os, re, sys
import numpy as np

sim, gpu = sys.argv[1], sys.argv[2]
rows = []
for f in sorted(os.listdir(sim)):
    if not f.startswith("cachalot__"):
        continue
    t = f[len("cachalot__"):-5]
    s = json.load(open(f"{sim}/{f}"))
    g = json.load(open(f"{gpu}/cachalot__{t}.json"))
    p = json.load(open(f"{gpu}/pytorch__{t}.json"))
    cp = json.load(open(f"{gpu}/cachalot-pytorch__{t}.json"))
    allocs, frees, steps, handles, again, unmaps, unpages, res, resfree = map(
        int, re.findall(r"\d+", s["driver_calls_detail"]))
    # The GPU run's own count of map steps and handles: the same program, the same decisions.
    gh = list(map(int, re.findall(r"\d+", g["driver_calls_detail"])))
    assert gh[2:4] == [steps, handles], (t, gh, steps, handles)
    n = s["lines"]
    rows.append(dict(t=t, n=n, handles=handles, again=again, unpages=unpages,
                     first=g["ns_per_op_first"] * n / 1e3, cpt=cp["ns_per_op_first"] * n / 1e3,
                     pt=p["ns_per_op_first"] * n / 1e3))
X = np.array([[r["handles"], r["again"], r["unpages"]] for r in rows], float)
y = np.array([r["first"] - r["cpt"] for r in rows])
w = 1 / np.array([r["first"] for r in rows])
coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
print("Fitted price per page, µs: a new handle (cuMemCreate + cuMemMap + cuMemSetAccess) %.1f, "
      "a page mapped again (cuMemMap + cuMemSetAccess) %.1f, a page unmapped (cuMemUnmap, "
      "cuMemRelease) %.1f.\n" % tuple(coef))
print("| trace | lines | handles made | pages mapped again | pages unmapped | first pass, ms | "
      "model, ms | PyTorch's first pass, ms | ÷ PyTorch's | driver work in the model |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r, x in zip(rows, X):
    drv = x @ coef
    print(f"| {r['t']} | {r['n']:,} | {r['handles']:,} | {r['again']:,} | {r['unpages']:,} | "
          f"{r['first'] / 1e3:,.1f} | {(r['cpt'] + drv) / 1e3:,.1f} | {r['pt'] / 1e3:,.2f} | "
          f"{r['first'] / r['pt']:.2f} | {drv / (r['cpt'] + drv) * 100:.0f} % |")
total = sum(r["first"] for r in rows)
print(f"\nAll {len(rows)} first passes: {total / 1e3:,.0f} ms on the GPU "
      f"(PyTorch's: {sum(r['pt'] for r in rows) / 1e3:,.0f} ms); in the model "
      + ", ".join(f"{name} {(X[:, i] * coef[i]).sum() / 1e3:,.0f} ms"
                  for i, name in enumerate(["new handles", "pages mapped again", "pages unmapped"]))
      + f", the rest (c-pt's first pass) {sum(r['cpt'] for r in rows) / 1e3:,.0f} ms.")
