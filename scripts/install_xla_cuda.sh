#!/usr/bin/env bash
# jax's CUDA PJRT plugin (jax-cuda13-plugin + jax-cuda13-pjrt, ~130 MB, matching the venv's jaxlib),
# installed --no-deps into <venv>/xla-cuda/<jaxlib version>, *not* into site-packages: only
# tests/test_gpu_compile.py puts it on the path (in a subprocess), for XLA's deviceless GPU compile.
# The rest of the suite never sees a CUDA plugin. XLA also needs ptxas (/usr/local/cuda/bin here).
#   bash scripts/install_xla_cuda.sh [path/to/venv/bin/python]
set -euo pipefail
py=${1:-.venv/bin/python}
ver=$("$py" -c 'import jaxlib; print(jaxlib.__version__)')
dest="$("$py" -c 'import sys; print(sys.prefix)')/xla-cuda/$ver"
if [ -d "$dest/jax_plugins" ]; then exit 0; fi
rm -rf "$dest.tmp"
"$py" -m pip install -q --no-deps --target "$dest.tmp" "jax-cuda13-plugin==$ver" "jax-cuda13-pjrt==$ver"
mv "$dest.tmp" "$dest"
echo "install_xla_cuda: jax CUDA plugin $ver in $dest"
