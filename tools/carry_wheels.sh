#!/usr/bin/env bash
# Fill a folder with the wheels the mesh needs beyond what the GPU machine ships (torch, Triton,
# transformers, tokenizers, numpy and safetensors are there), for that machine's Python, at the
# versions installed in this checkout's .venv; then print how to install them there. The GPU machine
# has no network, so a benchmark that starts services (gRPC, Redis, tracing, the gateway's JWT
# checks) or loads a GGUF file needs them carried.
#
#     tools/carry_wheels.sh [DIR] [PYTHON_VERSION]    # defaults: .whl (git-ignored) and 3.12
#
# Run `make setup` first (the versions are read from .venv). Add `.redis` from tools/carry_redis.sh
# for benchmarks that need a redis-server.
set -euo pipefail

dir=${1:-.whl}
python_version=${2:-3.12}
venv_python=.venv/bin/python
[[ -x $venv_python ]] || {
	echo "no .venv here: run 'make setup' first (the wheel versions are read from it)" >&2
	exit 1
}
# The mesh's imports that the GPU image lacks, and their own dependencies that it lacks too.
packages=(
	grpcio grpcio-health-checking grpcio-reflection protobuf googleapis-common-protos
	redis hiredis crc32c gguf PyJWT cryptography cffi starlette uvicorn wrapt
	opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions
	opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
	opentelemetry-instrumentation opentelemetry-instrumentation-grpc opentelemetry-instrumentation-redis
)
pins=()
for package in "${packages[@]}"; do
	version=$("$venv_python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package" 2>/dev/null) || {
		echo "$package is not installed in .venv; skipping it" >&2
		continue
	}
	pins+=("$package==$version")
done
mkdir -p "$dir"
"$venv_python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" \
	--python-version "$python_version" --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
	"${pins[@]}"

# A folder inside this repository stays out of git (wheels are never committed).
if root=$(git rev-parse --show-toplevel 2>/dev/null) && [[ $(readlink -f "$dir") == "$root"/* ]]; then
	exclude=$(git rev-parse --git-path info/exclude)
	git check-ignore -q "$dir/x.whl" || echo "/$(realpath --relative-to="$root" "$dir")/" >>"$exclude"
fi

count=$(find "$dir" -name '*.whl' | wc -l)
cat <<EOF
$count wheels in $dir ($(du -sh "$dir" | cut -f1)). Carry it with the run (carry: ["$dir"]) and, on the
GPU machine, before the benchmark:

    python3 -m pip install -q --no-index --no-deps --target /tmp/tcsite $dir/*.whl
    export PYTHONPATH=/tmp/tcsite:\$PWD/protos

(Keep /tmp/tcsite apart from any other --target folder, e.g. the vLLM bundle's /tmp/site.)
EOF
