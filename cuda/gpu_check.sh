#!/usr/bin/env bash
# `make gpu-check`: the whole GPU check in one run (for a machine with a CUDA device):
#   1. build the CUDA extension (torch.utils.cpp_extension, cached build folder),
#   2. run the GPU tests (tests/gpu incl. the end-to-end greedy / speculative runs, the sm_90
#      compile check),
#   3. run the kernel benchmark at Nemotron-H-8B shapes and print its table,
#   4. write the table with the date into benches/README.md (between the gpu-check markers),
#   5. time the demo model offline with CUDA graphs of decode steps and without.
# Exit status: non-zero if the build or a test failed (the benchmark still runs after failed tests).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${GPU_CHECK_OUT:-benches/results/tmp}
mkdir -p "$OUT"
status=0

echo "== device"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to torch: nothing to check (the CPU parts run in make test)"
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

echo "== build"
start=$(date +%s)
if ! $PY -c "from hybridserve.kernels import cuda; print(cuda.load_extension(verbose=False))"; then
  echo "BUILD FAILED"
  exit 1
fi
echo "build/load: $(( $(date +%s) - start )) s"

echo "== tests"
$PY -m pytest -q -rs tests/gpu tests/kernels/test_cuda_compile.py 2>&1 | tee "$OUT/gpu_tests.log"
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -eq 0 ] || status=1

echo "== benchmark"
table="$OUT/gpu_kernel_table.md"
if $PY benches/gpu_kernels.py --markdown "$table"; then
  summary=$(grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1)
  $PY - "$table" "$summary" <<'PYEOF'
import datetime, pathlib, re, sys
table = pathlib.Path(sys.argv[1]).read_text()
summary = sys.argv[2]
readme = pathlib.Path("benches/README.md")
text = readme.read_text() if readme.exists() else "# Benchmarks\n"
block = (
    "<!-- gpu-check:begin -->\n"
    f"Last `make gpu-check`: {datetime.date.today().isoformat()}. GPU tests: {summary or 'n/a'}.\n\n"
    + table
    + "<!-- gpu-check:end -->"
)
if "<!-- gpu-check:begin -->" in text:
    text = re.sub(r"<!-- gpu-check:begin -->.*?<!-- gpu-check:end -->", lambda m: block, text, flags=re.S)
else:
    text = text.rstrip() + "\n\n" + block + "\n"
readme.write_text(text)
print("benches/README.md updated")
PYEOF
else
  echo "BENCHMARK FAILED"
  status=1
fi

echo "== CUDA graphs: offline, graphs against eager"
# (the demo model, 64 x 256 -> 128 and 1 x 64 -> 256 tokens; each line: dtype, mode, output tok/s)
for dt in bfloat16 float32; do
  for shape in "64 256 128" "1 64 256"; do
    set -- $shape
    for mode in --no-enforce-eager --enforce-eager; do
      line=$($PY -m hybridserve bench offline --device cuda --warmup full --dtype "$dt" --num-prompts "$1" \
        --prompt-len "$2" --output-len "$3" "$mode" 2>&1 | grep -E "output tok/s" | tail -1)
      echo "$dt ${1}x$2->$3 $mode: ${line:-FAILED}"
    done
  done
done
exit $status
