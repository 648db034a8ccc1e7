#!/usr/bin/env bash
# Run pytest over PATHS split across N processes, and fail if any part fails or no test ran.
#
#     tools/split_tests.sh N PATH... [-- PYTEST_ARGS...]
#     tools/split_tests.sh 8 tests/engine/attention tests/engine/kv/test_demote_kernel.py -- -k bf16
#
# Meant for the GPU machine: there each Triton kernel variant a test launches is compiled on the
# CPU, one at a time in a process, and a serial run of the kernel tests takes longer than a device
# call allows (the machine has 16 cores). The processes share Triton's cache directory. The test
# ids are dealt out round-robin, so the parts take about the same share of each file.
set -uo pipefail

[[ $# -ge 2 ]] || {
	echo "usage: $0 N PATH... [-- PYTEST_ARGS...]" >&2
	exit 2
}
parts=$1
shift
paths=()
while [[ $# -gt 0 && $1 != "--" ]]; do
	paths+=("$1")
	shift
done
[[ ${1:-} == "--" ]] && shift
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m pytest --collect-only -q -p no:cacheprovider "${paths[@]}" "$@" 2>/dev/null |
	grep '::' >"$work/ids" || true
total=$(wc -l <"$work/ids")
if [[ $total -eq 0 ]]; then
	echo "no tests collected from ${paths[*]} $*" >&2
	exit 5
fi
awk -v n="$parts" -v dir="$work" '{ print > (dir "/part" (NR - 1) % n) }' "$work/ids"
pids=()
for list in "$work"/part*; do
	mapfile -t ids <"$list" # one argument per test id (parametrized ids may hold spaces)
	"$python" -m pytest -q -p no:cacheprovider "$@" "${ids[@]}" >"$list.log" 2>&1 &
	pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
	wait "$pid" || status=1
done
for log in "$work"/part*.log; do
	grep -E "^(FAILED|ERROR) " "$log"
	tail -n 1 "$log"
done
echo "$total tests in ${#pids[@]} parts: $([[ $status -eq 0 ]] && echo passed || echo FAILED)"
exit $status
