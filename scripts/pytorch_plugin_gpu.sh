#!/usr/bin/env bash
# Issue 24 on the GPU machine, one command: install the cachalot wheel into a venv that sees the
# machine's PyTorch, run the package's GPU tests (what a pluggable allocator receives and
# loses, python/tests/test_gpu.py), then the side-by-side training and inference benchmark
# (scripts/pytorch_plugin_bench.py). Everything lands in OUT/plugin.tgz (the device tool
# brings back few files), with OUT/results.md, OUT/pytest.log and OUT/machine.txt beside it.
#
#   bash scripts/pytorch_plugin_gpu.sh WHEEL OUT [bench args...]
#
# Run from a checkout of the repository (python/tests, scripts/, tests/fixtures/traces).
set -uo pipefail
wheel=$1; shift
dest=$1; shift
out=/tmp/plugin-out
rm -rf "$out"; mkdir -p "$out" "$dest"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, platform, torch; print(sys.version.split()[0], platform.libc_ver(), 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPUs')"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
# Into a folder of its own on the machine's python3 (which may itself be a venv, so a new venv
# would not see its PyTorch): the package, and the `cachalot` command in its bin/.
python3 -m pip install -q --no-deps --no-index --target /tmp/cachalot-pkg "$wheel" || exit 1
export PYTHONPATH=/tmp/cachalot-pkg${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/cachalot-pkg/bin:$PATH
python3 -c "import cachalot, torch; print('cachalot', cachalot.__version__, 'torch', torch.__version__)"
start=$(date +%s)
timeout "${PYTEST_TIMEOUT:-150}" python3 -m pytest -v -p no:cacheprovider python/tests > "$out/pytest.log" 2>&1
echo "pytest exit $? in $(( $(date +%s) - start ))s"; grep -E "passed|failed" "$out/pytest.log" | tail -1
grep -E "FAILED|ERROR" "$out/pytest.log" | head -20
start=$(date +%s)
timeout "${BENCH_TIMEOUT:-400}" python3 scripts/pytorch_plugin_bench.py --out "$out/bench" "$@" 2>&1 | tee "$out/bench.log" | tail -40
echo "bench in $(( $(date +%s) - start ))s"
tar czf "$dest/plugin.tgz" -C /tmp plugin-out
cp "$out/machine.txt" "$out/pytest.log" "$dest/" 2>/dev/null
cp "$out/bench/results.md" "$dest/" 2>/dev/null
ls -la "$dest"
