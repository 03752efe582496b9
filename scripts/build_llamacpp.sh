#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only, Release, native CPU flags) from the llama.cpp
# that the llama-cpp-python sdist on PyPI vendors in vendor/llama.cpp, as the peer that
# scripts/bench_peers.py runs beside Baton. Never runs in CI.
#
#   nice -n 19 scripts/build_llamacpp.sh      # ~10 min on 2 cores; prints the binary's path last
#
# Output: $BATON_CACHE_DIR/peers/llama.cpp-<version>/bin/llama-server, where <version> is
# the llama-cpp-python version and $BATON_CACHE_DIR defaults to <repo>/.cache (git-ignored,
# as scripts/test.sh uses it). A second run with the binary present prints its path and exits.
#
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  the sdist to build from (default below, the one measured)
#   BATON_CACHE_DIR           where peers/ goes (default <repo>/.cache)
#   PYTHON                    the Python whose pip downloads the sdist (default <repo>/.venv/bin/python, else python3)
#   JOBS                      parallel compile jobs (default: the number of processors)
#
# Downloads only the sdist, from PyPI (pip also fetches the sdist's build requirements from
# PyPI to read its metadata). The configure step turns off everything in llama.cpp's build that
# would fetch at build or run time: the web UI from Hugging Face (LLAMA_USE_PREBUILT_UI),
# libcurl model downloads (LLAMA_CURL, in versions that still have it), FetchContent.
# It does not install system packages: it names the Debian packages that are missing and
# stops, so that a build on a shared machine never changes the system behind your back.
set -euo pipefail

readonly DEFAULT_VERSION=0.3.36
root="$(cd "$(dirname "$0")/.." && pwd)"
version="${LLAMA_CPP_PYTHON_VERSION:-$DEFAULT_VERSION}"
cache="${BATON_CACHE_DIR:-$root/.cache}"
prefix="$cache/peers/llama.cpp-$version"
binary="$prefix/bin/llama-server"

die() { echo "build_llamacpp: $*" >&2; exit 1; }

if [ -x "$binary" ]; then
    echo "$binary"
    exit 0
fi

# System tools: Debian's cmake and g++ (make builds; ninja is used when present).
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || command -v ninja >/dev/null || missing+=(make)
if [ "${#missing[@]}" -gt 0 ]; then
    die "missing ${missing[*]}; install them with: sudo apt-get update && sudo apt-get install -y ${missing[*]}"
fi

python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
"$python" -m pip --version >/dev/null 2>&1 \
    || die "$python has no pip (set PYTHON to a Python with pip, or: sudo apt-get install -y python3-pip)"

jobs="${JOBS:-$(nproc)}"
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

mkdir -p "$prefix"
sdist_dir="$prefix/sdist"
work="$prefix/work"
started=$(date +%s)

# 1. The sdist, from PyPI only (kept: a rebuild after a failed compile does not fetch it again).
sdist="$sdist_dir/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    echo "build_llamacpp: downloading llama-cpp-python==$version (sdist) from PyPI" >&2
    "$python" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$version" -d "$sdist_dir" >&2
fi
[ -f "$sdist" ] || die "pip did not leave $sdist (listing: $(ls "$sdist_dir"))"

# 2. Unpack afresh: a half-unpacked tree from an interrupted run is never reused.
rm -rf "$work"
mkdir -p "$work"
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || die "no vendor/llama.cpp in the llama-cpp-python $version sdist"

# 3. Configure: CPU only, Release, -march=native (GGML_NATIVE), static libraries so the
#    binary does not depend on the build tree, and nothing that downloads. The sdist carries
#    the vendored llama.cpp's git metadata (a one-commit clone), so `llama-server --version`
#    names llama.cpp's own commit (0.3.36: "build 1, commit 0c1e570").
echo "build_llamacpp: configuring $src" >&2
cmake -S "$src" -B "$work/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CPU=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_RPC=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF \
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
    -Wno-dev >&2

# 4. Build the server target only.
echo "build_llamacpp: building llama-server with $jobs jobs" >&2
cmake --build "$work/build" --config Release --target llama-server -j "$jobs" >&2
built="$work/build/bin/llama-server"
[ -x "$built" ] || die "the build finished without $built"
"$built" --version >&2 || die "$built does not run"

# 5. Install atomically (a present binary means a finished build), then drop the work tree.
mkdir -p "$prefix/bin"
cp "$built" "$binary.tmp"
mv "$binary.tmp" "$binary"
rm -rf "$work"
echo "build_llamacpp: built in $(( $(date +%s) - started )) s" >&2
echo "$binary"
