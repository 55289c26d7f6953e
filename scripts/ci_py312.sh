#!/usr/bin/env bash
# Second CI leg: what the GPU machine runs (Python 3.12, jax 0.11.2, flax 0.12.12), on a fast
# subset: the kernels in interpret mode, the deviceless compile checks, config tests, and one
# engine run (scripts/device_check.py --interpret --quick: a tiny random model, a few buckets).
# Creates / updates its own venv (.venv312, gitignored); reinstalls only when pyproject.toml or
# this script change. Torch is not installed: nothing in this subset needs it.
#   bash scripts/ci_py312.sh            # or: PY312=/path/to/python3.12 bash scripts/ci_py312.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu
start=$(date +%s)

PY312=${PY312:-}
if [ -z "$PY312" ]; then
  for c in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.12.1/bin/python" \
           "$HOME/.pyenv/versions/3.12.1/bin/python" "$(command -v python3.12 || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then PY312=$c; break; fi
  done
fi
if [ -z "$PY312" ]; then echo "ci_py312: no Python 3.12 found (set PY312)" >&2; exit 1; fi

VENV=.venv312
PINS="jax==0.11.2 jaxlib==0.11.2 flax==0.12.12"
# GPU compile checks only: this leg mirrors the GPU machine. The TPU compile matrix (libtpu, ~45
# deviceless compiles) runs in the main leg on jax 0.10.2.
EXTRAS="compile-gpu"
STAMP="$VENV/.installed-$(cat pyproject.toml "$0" scripts/install_xla_cuda.sh | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  test -d "$VENV" || "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q $PINS -e ".[$EXTRAS]" pytest pytest-timeout hypothesis
  bash scripts/install_xla_cuda.sh "$VENV/bin/python"   # XLA's deviceless GPU compile (test_gpu_compile.py)
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
installed=$(date +%s)
echo "ci_py312: venv ready in $((installed - start)) s"
"$VENV/bin/python" - <<'EOF'
import sys, jax, flax
assert sys.version_info[:2] == (3, 12), sys.version
assert jax.__version__ == "0.11.2", jax.__version__
print(f"ci_py312: python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")
EOF

# The fast subset: every GPU kernel test and the dispatcher (interpreted), the reference against
# float64, the TPU kernel interpreted on the original cases (jax 0.11's TPU interpreter), the GPU
# compile matrix in bf16 through XLA's compiler (f32 tiles compile ~5x slower and are covered on
# jax 0.10.2), the config tests.
tests="tests/test_pallas_kernels.py tests/test_gpu_compile.py tests/test_config.py"
select="(test_pallas_kernels and (gpu or dispatcher or reference_vs_dense or lower_for or (tpu and kernel_vs_reference and (bf16 or mixed_ps8)))) or (test_gpu_compile and not float32) or test_config"
log=$(mktemp)
set +e
"$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider $tests -k "$select" ${PY312_PYTEST_ARGS:-} 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
tested=$(date +%s)
if [ "$rc" -ne 0 ]; then echo "ci_py312: pytest exited $rc" >&2; exit "$rc"; fi
grep -Eq '[0-9]+ passed' "$log" || { echo "ci_py312: no test passed" >&2; exit 1; }

# One engine run (Pallas backend, interpreted, vs the XLA reference) plus the device check's own
# kernel cases: the script the device machine runs, exercised on jax 0.11.2.
"$VENV/bin/python" scripts/device_check.py --interpret --quick --out "$(mktemp -d)/device_check.json" | tail -n 12
end=$(date +%s)
echo "ci_py312: install $((installed - start)) s, tests $((tested - installed)) s, device_check $((end - tested)) s, total $((end - start)) s"
