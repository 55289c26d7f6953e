#!/usr/bin/env bash
# libtpu (the real Mosaic TPU compiler, ~700 MB unpacked), the version jax's own "tpu" extra pins
# for the venv's jax, installed --no-deps into <venv>/libtpu/<jax version>, *not* into
# site-packages: with libtpu importable, every jax process probes for a TPU and logs a page of
# errors. Only scripts/tpu_compile_matrix.py (and tests/test_tpu_compile.py through it) put this
# folder on the path, in their own processes, for deviceless compiles.
#   bash scripts/install_libtpu.sh [path/to/venv/bin/python]
set -euo pipefail
py=${1:-.venv/bin/python}
ver=$("$py" -c 'import jax; print(jax.__version__)')
dest="$("$py" -c 'import sys; print(sys.prefix)')/libtpu/$ver"
if [ -d "$dest/libtpu" ]; then exit 0; fi
report=$(mktemp)
"$py" -m pip install -q --dry-run --ignore-installed --report "$report" "jax[tpu]==$ver" 2>/dev/null
pin=$("$py" -c 'import json, sys
print(next("libtpu==" + i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]
           if i["metadata"]["name"] == "libtpu"))' "$report")
rm -f "$report"
rm -rf "$dest.tmp"
"$py" -m pip install -q --no-deps --target "$dest.tmp" "$pin"
mv "$dest.tmp" "$dest"
echo "install_libtpu: $pin in $dest"
