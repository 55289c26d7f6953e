#!/usr/bin/env bash
# llama.cpp's llama-server (CPU only, Release, -DGGML_NATIVE=ON, no CURL), the peer that
# scripts/bench_llama_cpp.py measures jaxserve against. GitHub is not reachable from the dev hosts,
# so the sources come from the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python
# (pinned below), fetched with pip. Idempotent: does nothing when the binary exists.
# Not part of CI nor of `make install`. No network at build time: the web UI is neither built
# (npm) nor fetched (Hugging Face bucket), so llama-server serves an empty UI; its API is unaffected.
#   bash scripts/install_llama_cpp.sh [path/to/python]      # default .venv/bin/python
# Result: $HOME/.cache/jaxserve/llama-cpp/build/bin/llama-server (override the root with
# JAXSERVE_LLAMA_CPP_DIR; the build uses at most JOBS=2 jobs, under nice -n 19).
set -euo pipefail
py=${1:-.venv/bin/python}
pin=0.3.36
root=${JAXSERVE_LLAMA_CPP_DIR:-$HOME/.cache/jaxserve/llama-cpp}
jobs=${JOBS:-2}
bin="$root/build/bin/llama-server"
if [ -x "$bin" ]; then exit 0; fi
command -v cmake >/dev/null || { echo "install_llama_cpp: cmake missing (pip install cmake ninja)" >&2; exit 1; }
mkdir -p "$root"
src="$root/llama_cpp_python-$pin/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
  dl=$(mktemp -d)
  "$py" -m pip download -q --no-deps --no-binary :all: -d "$dl" "llama-cpp-python==$pin"
  tar xzf "$dl/llama_cpp_python-$pin.tar.gz" -C "$root"
  rm -rf "$dl"
fi
# AMX off (-mno-amx-*, GGML_NATIVE otherwise kept): on this project's Sapphire-Rapids-class VMs the
# native build's AMX path segfaults at the first matmul (ldtilecfg in ggml_backend_amx_mul_mat while
# the server loads the model): llama.cpp issue 20824, fix proposed in PR 26954 (the tile config on
# the stack is optimized away; permission only asked for on the main thread).
noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
gen=()
if command -v ninja >/dev/null; then gen=(-G Ninja); fi
nice -n 19 cmake -S "$src" -B "$root/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx"
nice -n 19 cmake --build "$root/build" -j"$jobs" --target llama-server
test -x "$bin"
echo "install_llama_cpp: llama.cpp (llama-cpp-python==$pin) llama-server in $bin"
