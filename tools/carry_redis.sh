#!/usr/bin/env bash
# Fill a folder with this machine's redis-server and the shared libraries it needs beyond glibc, to
# carry to a machine that has no Redis and no network (the GPU machine), then print how to use it.
#
#     tools/carry_redis.sh [DIR]          # DIR defaults to .redis (at the repo root: git-ignored)
#
# DIR/redis-server is a wrapper that sets LD_LIBRARY_PATH=DIR/lib for redis-server alone and execs
# DIR/lib/redis-server.bin. The libraries are not exported to the shell on purpose: this machine's
# libstdc++, libssl and libcrypto ahead of the target's in a Python process could break torch or ssl.
# glibc itself (libc, libm, the loader and friends) comes from the target, which must be as new as
# this machine's (`ldd --version`).
set -euo pipefail

dir=${1:-.redis}
binary=$(command -v redis-server) || {
	echo "redis-server is not installed here (apt-get install redis-server)" >&2
	exit 1
}
mkdir -p "$dir/lib"
cp -L "$binary" "$dir/lib/redis-server.bin"
ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
	case $(basename "$lib") in
	libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | libresolv.so.* | ld-linux*) ;;
	*) cp -L "$lib" "$dir/lib/" ;;
	esac
done
cat >"$dir/redis-server" <<'EOF'
#!/bin/sh
# redis-server with its carried libraries (tools/carry_redis.sh); LD_LIBRARY_PATH is set for it alone
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/lib/redis-server.bin" "$@"
EOF
chmod +x "$dir/redis-server"

# A folder inside this repository stays out of git (binaries are never committed).
if root=$(git rev-parse --show-toplevel 2>/dev/null) && [[ $(readlink -f "$dir") == "$root"/* ]]; then
	exclude=$(git rev-parse --git-path info/exclude)
	git check-ignore -q "$dir/redis-server" || echo "/$(realpath --relative-to="$root" "$dir")/" >>"$exclude"
fi

echo "carried $("$dir/redis-server" --version | cut -d' ' -f1-3) and $(ls "$dir/lib" | wc -l) files in $dir ($(du -sh "$dir" | cut -f1))" >&2
# run from this folder's parent on the target; an absolute DIR is printed as it is
[[ $dir == /* ]] && where=$dir || where="\$PWD/${dir#./}"
echo "export THERMOCLINE_REDIS_SERVER=$where/redis-server"
