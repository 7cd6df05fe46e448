#!/usr/bin/env python3
"""Real PyTorch training and inference on cachalot's plug-in, beside native PyTorch (issue 24,
part 4). One command, one table.

For each workload and each mode, a fresh process:

  native           PyTorch's own caching allocator, default settings
  plugin-pytorch   cachalot.torch.install(pytorch=True): PyTorch's policy inside cachalot
  plugin-cachalot  cachalot.torch.install(): cachalot's policy (expandable segments with 2 MiB
                   pages, reclaim, thread caches)

Each process seeds everything, turns on deterministic algorithms (cuDNN deterministic, no
benchmark mode, CUBLAS_WORKSPACE_CONFIG=:4096:8, eager attention), draws the same inputs and
the same shapes in the same order, and runs WARMUP + STEPS steps, synchronising after each.
Measured by the device, not by the allocator:

  peak device memory  the highest `total - free` of cuMemGetInfo (what torch.cuda.mem_get_info()
                      reads) seen by cachalot.torch.DeviceMemorySampler, a native thread reading
                      every 200 us without the interpreter lock, from the moment CUDA was up
                      (after a 1-element tensor) to the end; minus the reading at that moment
                      (`base`: context, libraries): the memory the job took. The step-end
                      torch.cuda.mem_get_info() readings are kept too (never above the sampler's)
  step time           wall time of each step to its synchronisation; the mean and median over
                      the STEPS steps after the warm-up

and, from the allocator, its own peak reserved and allocated bytes (torch.cuda.max_memory_*,
which the plug-in answers once installed). Losses (training) or output sums (inference) of
every step are compared with native PyTorch's.

Then the memory-limit job (--oom-workload, default bert_infer_varied): a limit is set with
torch.cuda.set_per_process_memory_fraction at 1.10 x the peak reserved of cachalot's policy
in the first phase (then 1.05 x, 1.02 x if native PyTorch still fits), and the job runs under
native PyTorch and under cachalot's policy at the same limit.

Writes OUT/results.json (every figure), OUT/results.md (the tables), OUT/runs/*.json (each
process's figures) and OUT/logs/*.log. Usage:

  python3 scripts/pytorch_plugin_bench.py --out OUT [--steps 50] [--warmup 5]
      [--workloads a,b] [--modes native,plugin-pytorch,plugin-cachalot] [--no-oom]
      [--rounds N]

With --rounds N every workload runs N rounds of one process per mode, the modes' order rotated
each round (round 0: native first; round 1: the second mode first; ...), so that order and
drift on a shared machine fall on every allocator alike. Step-time ratios are then taken per
round against that round's native process, and the table shows their median and range
(min-max) over the rounds beside the median of the processes' own means.

Needs PyTorch with CUDA, torchvision, transformers, and the cachalot package (pip install .,
or its wheel) importable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

MODES = ["native", "plugin-pytorch", "plugin-cachalot"]
SCHEMA = "cachalot pytorch-plugin v1"

# name: (kind, shapes, description)
WORKLOADS: Dict[str, Tuple[str, str, str]] = {
    "resnet50_train": ("CNN training", "fixed", "ResNet-50, batch 64, 224x224, SGD, bf16 autocast"),
    "resnet50_multiscale": (
        "CNN training",
        "varied",
        "ResNet-50, batch 16-96 x 128-320 px (multi-scale), SGD, bf16 autocast",
    ),
    "gpt2_train": ("transformer training", "fixed", "GPT-2 124M, batch 8 x 512 tokens, AdamW, bf16 autocast"),
    "gpt2_train_varied": (
        "transformer training",
        "varied",
        "GPT-2 124M, batch 2-16 x 64-1024 tokens (<= 8192 a step), AdamW, bf16 autocast",
    ),
    "bert_infer_varied": (
        "transformer inference",
        "varied",
        "BERT-base, no_grad, batch 1-32 x 16-512 tokens",
    ),
}


# --- the worker --------------------------------------------------------------------------

ATTN: List[Any] = []  # the attention implementation the transformer models use


def _seed(torch: Any, seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build(name: str, torch: Any, steps: int) -> Tuple[Callable[[int], float], List[Any]]:
    """The workload's step function (step index -> its loss or output sum) and its shapes."""
    dev = "cuda"
    rng = random.Random(1234)
    if name.startswith("resnet50"):
        import torchvision

        model = torchvision.models.resnet50(num_classes=1000).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if name == "resnet50_train":
            shapes = [(64, 224)] * steps
        else:
            shapes = [(rng.choice(range(16, 97, 16)), rng.choice(range(128, 321, 32))) for _ in range(steps)]

        def step(i: int) -> float:
            b, px = shapes[i]
            g = torch.Generator(device=dev).manual_seed(i)
            x = torch.randn(b, 3, px, px, device=dev, generator=g)
            y = torch.randint(0, 1000, (b,), device=dev, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return float(loss.item())

        return step, shapes
    if name.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
        cfg._attn_implementation = "eager"  # deterministic backward (no fused attention)
        model = GPT2LMHeadModel(cfg).to(dev)
        ATTN.append(getattr(model.config, "_attn_implementation", None))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "gpt2_train":
            shapes = [(8, 512)] * steps
        else:
            shapes = []
            for _ in range(steps):
                seq = rng.choice(range(64, 1025, 64))
                batch = rng.randint(2, max(2, min(16, 8192 // seq)))
                shapes.append((batch, seq))

        def step(i: int) -> float:
            b, t = shapes[i]
            g = torch.Generator(device=dev).manual_seed(i)
            ids = torch.randint(0, cfg.vocab_size, (b, t), device=dev, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return float(loss.item())

        return step, shapes
    if name == "bert_infer_varied":
        from transformers import BertConfig, BertModel

        cfg = BertConfig()
        cfg._attn_implementation = "eager"
        model = BertModel(cfg).to(dev).eval()
        ATTN.append(getattr(model.config, "_attn_implementation", None))
        shapes = [(rng.randint(1, 32), rng.randint(16, 512)) for _ in range(steps)]

        def step(i: int) -> float:
            b, t = shapes[i]
            g = torch.Generator(device=dev).manual_seed(i)
            ids = torch.randint(0, cfg.vocab_size, (b, t), device=dev, generator=g)
            with torch.no_grad():
                out = model(input_ids=ids).last_hidden_state
            return float(out.float().sum().item())

        return step, shapes
    raise SystemExit(f"unknown workload {name}")


def worker(a: argparse.Namespace) -> None:
    out: Dict[str, Any] = {"schema": SCHEMA, "workload": a.worker, "mode": a.mode, "limit": a.limit}
    t_start = time.perf_counter()
    import torch

    out["torch"] = torch.__version__
    ct = None
    if a.mode != "native":
        import cachalot.torch as ct

        out["settings"] = ct.install(pytorch=(a.mode == "plugin-pytorch"))
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out["gpu"] = torch.cuda.get_device_name(0)
    out["total"] = total
    out["base_used"] = total - free
    if a.limit:
        torch.cuda.set_per_process_memory_fraction(a.limit / total)
        out["fraction"] = a.limit / total
    import cachalot.torch as sampling

    sampler = sampling.DeviceMemorySampler(0, 200).start()
    _seed(torch, 0)
    n = a.warmup + a.steps
    values: List[float] = []
    times: List[float] = []
    step_end_used = 0
    error: Optional[str] = None
    try:
        step, shapes = build(a.worker, torch, n)
        out["shapes"] = shapes
        out["attention"] = ATTN[0] if ATTN else None
        torch.cuda.synchronize()
        for i in range(n):
            t0 = time.perf_counter()
            v = step(i)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            values.append(v)
            f, _ = torch.cuda.mem_get_info()
            step_end_used = max(step_end_used, total - f)
    except Exception as e:  # an out-of-memory error under a limit is a result, not a crash
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out["oom"] = (ct.is_out_of_memory(e) if ct else isinstance(e, torch.cuda.OutOfMemoryError)) or (
            "out of memory" in str(e)
        )
        out["failed_at_step"] = len(values)
    readings = sampler.stop()
    out["error"] = error
    out["values"] = values
    out["step_times"] = times
    timed = times[a.warmup :]
    out["steps_done"] = len(values)
    out["timed_steps"] = len(timed)
    out["step_mean_s"] = statistics.fmean(timed) if timed else None
    out["step_median_s"] = statistics.median(timed) if timed else None
    out["device"] = readings
    out["peak_used"] = readings["peak_used"]
    out["job_peak"] = readings["peak_used"] - out["base_used"]
    out["step_end_used"] = step_end_used
    try:
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
        s = torch.cuda.memory_stats()
        out["num_device_alloc"] = s.get("num_device_alloc")
        out["num_device_free"] = s.get("num_device_free")
        out["num_alloc_retries"] = s.get("num_alloc_retries")
        out["num_ooms"] = s.get("num_ooms")
    except Exception as e:
        out["stats_error"] = str(e)
    out["process_s"] = time.perf_counter() - t_start
    with open(a.result, "w") as f:
        json.dump(out, f)


# --- the parent --------------------------------------------------------------------------


def spawn(a: argparse.Namespace, workload: str, mode: str, limit: Optional[int], tag: str) -> Dict[str, Any]:
    runs = os.path.join(a.out, "runs")
    logs = os.path.join(a.out, "logs")
    os.makedirs(runs, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    result = os.path.join(runs, f"{tag}.json")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        workload,
        "--mode",
        mode,
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--result",
        result,
    ]
    if limit:
        cmd += ["--limit", str(limit)]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONHASHSEED="0")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CACHALOT_ALLOC_CONF", None)
    t0 = time.time()
    with open(os.path.join(logs, f"{tag}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    try:
        with open(result) as f:
            r: Dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        r = {"workload": workload, "mode": mode, "limit": limit, "error": f"process ended ({rc}) without a result"}
    r["rc"] = rc
    r["wall_s"] = round(time.time() - t0, 1)
    print(
        f"  {tag:45s} rc={rc} {r.get('wall_s')}s steps={r.get('steps_done')} "
        f"job_peak={gib(r.get('job_peak'))} step={ms(r.get('step_mean_s'))} err={r.get('error')}",
        flush=True,
    )
    return r


def gib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 2**30:.3f}"


def ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def ratio(x: Optional[float], y: Optional[float]) -> str:
    if x is None or y is None or y == 0:
        return "-"
    return f"{x / y:.3f}"


def agreement(r: Dict[str, Any], native: Dict[str, Any]) -> str:
    a, b = r.get("values") or [], native.get("values") or []
    if not a or len(a) != len(b):
        return "-"
    if a == b:
        return "identical"
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    return f"max rel. diff {worst:.1e}"


def round_table(results: List[Dict[str, Any]]) -> List[str]:
    """Step time over interleaved rounds: per round, each mode's mean step time over that
    round's native process; the median and range of those ratios, and the median of the
    processes' means and peaks."""
    rounds = sorted({r.get("round", 0) for r in results})
    if len(rounds) < 2:
        return []
    lines = [
        "",
        f"Interleaved rounds ({len(rounds)} per workload, the modes' order rotated each round):",
        "",
        "| workload | allocator | rounds | step time mean, median of rounds (ms) | × native per round: median | × native per round: min–max | job's peak device memory, median (GiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    by: Dict[Tuple[str, str, int], Dict[str, Any]] = {
        (r["workload"], r["mode"], r.get("round", 0)): r for r in results if not r.get("error")
    }
    for w in dict.fromkeys(r["workload"] for r in results):
        for m in MODES:
            means, ratios, peaks = [], [], []
            for k in rounds:
                r = by.get((w, m, k))
                if r is None or r.get("step_mean_s") is None:
                    continue
                means.append(r["step_mean_s"])
                if r.get("job_peak") is not None:
                    peaks.append(r["job_peak"])
                n = by.get((w, "native", k))
                if n and n.get("step_mean_s"):
                    ratios.append(r["step_mean_s"] / n["step_mean_s"])
            if not means:
                continue
            spread = f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else "-"
            med = f"{statistics.median(ratios):.3f}" if ratios else "-"
            lines.append(
                f"| {w} | {m} | {len(means)} | {ms(statistics.median(means))} | {med} | {spread} | "
                f"{gib(statistics.median(peaks) if peaks else None)} |"
            )
    return lines


def tables(results: List[Dict[str, Any]], oom: List[Dict[str, Any]]) -> str:
    lines = [
        "| workload | shapes | allocator | steps | losses / outputs vs native | job's peak device memory (GiB) | × native | allocator's peak reserved (GiB) | step time mean (ms) | × native | median (ms) | × native |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["workload"], r["mode"]): r for r in results if r.get("round", 0) == 0}
    for w in dict.fromkeys(r["workload"] for r in results):
        native = by.get((w, "native"), {})
        for m in MODES:
            r = by.get((w, m))
            if r is None:
                continue
            agree = "(reference)" if m == "native" else agreement(r, native)
            if r.get("error"):
                agree = f"error: {r['error']}"
            lines.append(
                f"| {w} | {WORKLOADS.get(w, ('', '-', ''))[1]} | {m} | {r.get('timed_steps', '-')} | {agree} | "
                f"{gib(r.get('job_peak'))} | {ratio(r.get('job_peak'), native.get('job_peak'))} | "
                f"{gib(r.get('peak_reserved'))} | {ms(r.get('step_mean_s'))} | "
                f"{ratio(r.get('step_mean_s'), native.get('step_mean_s'))} | {ms(r.get('step_median_s'))} | "
                f"{ratio(r.get('step_median_s'), native.get('step_median_s'))} |"
            )
    lines += round_table(results)
    if oom:
        lines += [
            "",
            "| memory-limit job | limit (GiB) | allocator | outcome | steps done | job's peak device memory (GiB) | allocator's peak reserved (GiB) |",
            "|---|---:|---|---|---:|---:|---:|",
        ]
        for r in oom:
            outcome = "out of memory" if r.get("oom") else ("error" if r.get("error") else "finished")
            lines.append(
                f"| {r['workload']} | {gib(r.get('limit'))} | {r['mode']} | {outcome} | {r.get('steps_done')} | "
                f"{gib(r.get('job_peak'))} | {gib(r.get('peak_reserved'))} |"
            )
    return "\n".join(lines)


def parent(a: argparse.Namespace) -> int:
    os.makedirs(a.out, exist_ok=True)
    workloads = a.workloads.split(",") if a.workloads else list(WORKLOADS)
    modes = a.modes.split(",")
    results: List[Dict[str, Any]] = []
    started = time.time()
    print(f"{len(workloads)} workloads x {len(modes)} allocators, {a.warmup}+{a.steps} steps", flush=True)
    oom: List[Dict[str, Any]] = []
    for w in workloads:
        for k in range(a.rounds):
            order = modes[k % len(modes):] + modes[: k % len(modes)]
            for m in order:
                tag = f"{w}__{m}" if a.rounds == 1 else f"{w}__{m}__r{k}"
                r = spawn(a, w, m, None, tag)
                r["round"] = k
                results.append(r)
                write(a, results, oom)  # what is done so far survives a time limit
    if a.oom_workload and not a.no_oom:
        base = next(
            (r for r in results if r["workload"] == a.oom_workload and r["mode"] == "plugin-cachalot"), None
        )
        if base and base.get("peak_reserved") and not base.get("error"):
            for factor in (1.10, 1.05, 1.02):
                limit = int(base["peak_reserved"] * factor)
                nat = spawn(a, a.oom_workload, "native", limit, f"limit{factor:.2f}__{a.oom_workload}__native")
                nat["factor"] = factor
                cach = spawn(
                    a, a.oom_workload, "plugin-cachalot", limit, f"limit{factor:.2f}__{a.oom_workload}__plugin-cachalot"
                )
                cach["factor"] = factor
                oom += [nat, cach]
                write(a, results, oom)
                if nat.get("oom"):
                    break
                if time.time() - started > a.budget:
                    break
    text = write(a, results, oom)
    print(text)
    return 0 if all(not r.get("error") for r in results) else 1


def write(a: argparse.Namespace, results: List[Dict[str, Any]], oom: List[Dict[str, Any]]) -> str:
    """Writes OUT/results.json and OUT/results.md; returns the tables."""
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        machine["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        pass
    first = next((r for r in results if r.get("torch")), {})
    machine["torch"] = first.get("torch")
    machine["gpu"] = first.get("gpu")
    text = tables(results, oom)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"schema": SCHEMA, "machine": machine, "args": vars(a), "runs": results, "limit_runs": oom}, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(f"machine: {json.dumps(machine)}\n\n{text}\n")
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="plugin-bench")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workloads", default="")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--oom-workload", default="bert_infer_varied")
    p.add_argument("--no-oom", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every mode per workload")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--budget", type=float, default=420, help="no new memory-limit try after this many seconds")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
