#!/usr/bin/env bash
# The prepared GPU run, for the project's GPU machine as it is: Python 3.12 with torch 2.11.0+cu130 preinstalled,
# no network, no venv (its image has pytest, pyyaml, wrapt, numpy, hypothesis, transformers 5.x, lightning 2.6,
# accelerate, matplotlib). Nothing is installed: the machine's own python3 and torch run the checkout from
# PYTHONPATH. Run from the repo root:
#   bash benchmarks/gpu_check.sh             # on the GPU machine: CUDA tests, step time fp16/bf16, experiment on CUDA
#   bash benchmarks/gpu_check.sh --dry-run   # anywhere: CUDA hidden (CUDA tests skip), the same steps, short, on CPU
# Writes everything under ${OUT:-gpu_out}; each part is capped with `timeout` (7 min 40 s in all, under 8 min).
# Tests whose pinned test extras (setup.cfg [options.extras_require] test) differ from what is installed are
# skipped (not run), and listed in $out/skipped_pins.txt. Exit status: the tests' (0 when they pass or skip).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-gpu_out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
py="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
cd "$root"
if [ "$dry" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=
    bench=(--device cpu --quick --case mlp) exp=(--device cpu --steps 5 --rounds 1 --model mlp --variants fp32,O1,native --half-dtype bfloat16)
    fp8=(--device cpu --steps 6 --rounds 1)
else
    bench=(--device cuda --rounds 3) exp=(--device cuda --steps 40 --rounds 1 --model all --half-dtype float16)
    fp8=(--device cuda --steps 30 --rounds 3)
fi

step() {  # step NAME SECONDS COMMAND...: run one capped part, its output in $out/NAME.txt, one status line here
    local name="$1" limit="$2" start=$SECONDS rc
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1
    rc=$?
    echo "gpu_check: $name: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] && echo " (timed out at $limit s)")"
    return $rc
}

step device 60 "$py" -c "
import sys, torch, amp_patch
from amp_patch._torch import compat as torch_compat
cuda = torch.cuda.is_available()
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| device', torch.cuda.get_device_name(0) if cuda else 'none (CUDA hidden or absent)')
print('amp_patch', amp_patch.__version__, 'from', amp_patch.__file__, '| torch in the tested range:', torch_compat.tested())
"

# Test files that import a test extra whose installed version is outside setup.cfg's pin (transformers 5.x
# here against the pinned 4.57, say) are ignored; a missing extra is left to the tests' own importorskip.
"$py" - "$out/skipped_pins.txt" >"$out/ignore_args.txt" <<'EOF'
import configparser, importlib.metadata as md, pathlib, re, sys
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
mismatched, notes = set(), []
for line in cfg["options.extras_require"]["test"].split("\n"):
    match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", line)
    if not match or not match.group(2):
        continue
    name, spec = match.group(1), match.group(2)
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        continue
    release = tuple(int(p) for p in re.findall(r"\d+", have)[:3])
    ok = True
    for op, bound in re.findall(r"(>=|<|==)\s*([0-9.]+)", spec):
        b = tuple(int(p) for p in bound.split("."))
        r = release[:len(b)]
        ok &= {">=": r >= b, "<": r < b, "==": r == b}[op]
    if not ok:
        mismatched.add(name.lower())
        notes.append(f"{name} {have} installed, setup.cfg pins {spec}")
ignored = []
for test in sorted(pathlib.Path("tests").glob("*.py")):
    text = test.read_text(encoding="utf-8")
    if any(re.search(rf"^\s*(import|from)\s+{re.escape(m)}\b|importorskip\(\s*[\"']{re.escape(m)}\b", text, re.M)
           for m in mismatched):
        ignored.append(str(test))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(notes + [f"ignored: {t}" for t in ignored]) + "\n")
print(" ".join(f"--ignore={t}" for t in ignored))
EOF
read -r -a ignore <"$out/ignore_args.txt" || true
echo "gpu_check: pins: $(tr '\n' ';' <"$out/skipped_pins.txt")"

# The CUDA tests, then the checks that depend on the torch version (op lists, casting, compile, RNNs).
step tests 150 "$py" -m pytest -q -p no:cacheprovider -rs "${ignore[@]}" tests/integration/test_cuda.py tests/integration/test_torch_versions.py \
    tests/behaviour/test_compile_keeps_casts.py tests/behaviour/test_rnns_in_half.py tests/behaviour/test_loss_scaling_end_to_end.py tests/unit/test_cast_cache_counts.py \
    tests/oracle/test_torch_list_conformance.py tests/unit/test_casting_rules.py \
    tests/integration/test_cuda_fp8.py tests/behaviour/test_fp8_op_lists.py
tests_rc=$?
step step_fp16 55 "$py" benchmarks/bench_step_time.py "${bench[@]}" --dtype float16
step step_bf16 55 "$py" benchmarks/bench_step_time.py "${bench[@]}" --dtype bfloat16
step experiment 100 "$py" -m amp_patch experiment "${exp[@]}" --no-progress \
    --out "$out/experiment"
# fp8 (F.linear in float8) against bf16 O1 and fp32: loss and step time; torchao's rows only where it imports
# (not on the GPU machine's image). Float8 kernels need compute capability >= 8.9 (H200: 9.0).
step fp8 40 "$py" benchmarks/bench_fp8.py "${fp8[@]}"

echo "gpu_check: mode $([ $dry = 1 ] && echo "dry run (CUDA hidden, CPU, short)" || echo "GPU") -> $out"
tail -n 2 "$out/device.txt" "$out/tests.txt"
grep -h "^| " "$out/step_fp16.txt" "$out/step_bf16.txt" | head -n 12
grep -h -A8 "^### " "$out/experiment.txt" | head -n 24
grep -h "^| \|steps, batch" "$out/fp8.txt" | head -n 9
if [ "$dry" = 1 ]; then
    cat <<'NOTE'
gpu_check: this was the dry run. On the GPU machine (no --dry-run) the same steps print: the device line with
  "cuda 13.0 | device NVIDIA H200"; tests.txt with tests/integration/test_cuda.py and the CUDA LSTM/GRU checks run, not
  skipped (about 10 more tests); step_fp16/step_bf16 tables for all three cases on cuda (3 rounds, fp32, native,
  O1, O2 and the cast-count check); the experiment's three tables (mlp, cnn, transformer) in float16 on cuda,
  with syncs/step measured instead of "n/a (CPU)"; fp8.txt with fp8 (tensorwise, rowwise) vs bf16 O1 step times
  on cuda (float8 tensor cores) and tests/integration/test_cuda_fp8.py run, not skipped.
NOTE
fi
exit $tests_rc
