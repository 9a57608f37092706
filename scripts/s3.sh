#!/usr/bin/env bash
# A real S3-compatible server (SeaweedFS) built from the Go module proxy, for the s3:// tests
# (tests/s3/) and anyone who wants an object store on loopback:
#
#   scripts/s3.sh build          weed into a cache keyed by its version
#   scripts/s3.sh up DIR [BIND]  start `weed server` (master, volume, filer and S3 gateway in
#                                one process) on 127.0.0.1, all state in DIR; writes DIR/env (the
#                                endpoint and the identities' keys, shell syntax); returns when
#                                the S3 gateway answers. BIND (default 127.0.0.1): the address
#                                it listens on; 0.0.0.0 lets pods on a real node's bridge reach
#                                it at the bridge's address (tests/cluster/test_real_gang.py)
#   scripts/s3.sh down DIR       stop what `up` started (by pid)
#   scripts/s3.sh bin            print the folder holding weed
#
# Identities (DIR/s3.json, SeaweedFS's static identity file):
#   admin   ftjob-admin / <random>    every action on every bucket
#   reader  ftjob-reader / <random>   Read and List of bucket public only (denied elsewhere,
#                                     and every write denied)
# A key pair no identity holds is a refused credential.
#
# SeaweedFS's go.mod replaces one dependency (go-bip39), so `go install ...@version` is refused:
# the build writes a local module that requires it and repeats the replace. The module and build
# caches are Go's own (the ones scripts/k8s.sh fills); the binary lives outside the repository:
# ${FTJOB_S3_CACHE:-~/.cache/ftjob/s3}/<version>/bin/weed. From empty module and build caches the
# build took 368 s on the 2-core machine (load average 5-8); cached, `up` takes ~3 s.
set -euo pipefail

WEED_VERSION=v0.0.0-20261109003541-7506e5f91cd6
GO_DIRECTIVE=1.26.6
CACHE="${FTJOB_S3_CACHE:-$HOME/.cache/ftjob/s3}/seaweedfs-$WEED_VERSION"
BIN="$CACHE/bin"

die() { echo "s3.sh: $*" >&2; exit 1; }

weed_module() {
  printf 'module ftjob.dev/s3server\n\ngo %s\n\n' "$GO_DIRECTIVE"
  printf 'require github.com/seaweedfs/seaweedfs %s\n\n' "$WEED_VERSION"
  printf 'replace github.com/tyler-smith/go-bip39 => github.com/cosmos/go-bip39 v1.0.0\n\n'
  printf 'tool github.com/seaweedfs/seaweedfs/weed\n'
}

cmd_build() {
  if [[ -x "$BIN/weed" ]]; then echo "s3.sh: cached in $BIN"; return; fi
  command -v go >/dev/null || die "go is not installed (Go >= $GO_DIRECTIVE builds weed)"
  local src="$CACHE/src"
  mkdir -p "$src" "$BIN" && weed_module >"$src/go.mod"
  (cd "$src" && go mod tidy)
  (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$BIN/weed.new" \
    github.com/seaweedfs/seaweedfs/weed)
  mv "$BIN/weed.new" "$BIN/weed"
  echo "s3.sh: built into $BIN"
}

# A free port below 55536 (SeaweedFS serves gRPC on each HTTP port + 10000), on every address:
# free whichever BIND `up` is given.
free_port() {
  python3 -c '
import random, socket
while True:
    p = random.randrange(20000, 55000)
    try:
        socket.create_server(("", p)).close(); socket.create_server(("", p + 10000)).close()
    except OSError:
        continue
    print(p); break'
}

secret() { python3 -c 'import secrets; print(secrets.token_hex(16))'; }

identities() {
  local admin_secret=$1 reader_secret=$2
  cat <<EOF
{"identities": [
  {"name": "admin", "credentials": [{"accessKey": "ftjob-admin", "secretKey": "$admin_secret"}],
   "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
  {"name": "reader", "credentials": [{"accessKey": "ftjob-reader", "secretKey": "$reader_secret"}],
   "actions": ["Read:public", "List:public"]}
]}
EOF
}

# The ports are chosen once and kept in DIR/env, so `up` after `down` (a server stopped and
# started again) serves the same endpoint and the same data.
write_env() {
  local admin_secret reader_secret
  admin_secret=$(secret) reader_secret=$(secret)
  identities "$admin_secret" "$reader_secret" >"$DIR/s3.json"
  cat >"$DIR/env" <<EOF
S3_PORT=$(free_port)
MASTER_PORT=$(free_port)
VOLUME_PORT=$(free_port)
FILER_PORT=$(free_port)
ADMIN_ACCESS_KEY=ftjob-admin
ADMIN_SECRET_KEY=$admin_secret
READER_ACCESS_KEY=ftjob-reader
READER_SECRET_KEY=$reader_secret
EOF
  echo "ENDPOINT=http://127.0.0.1:$(. "$DIR/env" && echo "$S3_PORT")" >>"$DIR/env"
}

cmd_up() {
  DIR=${1:-}
  local bind=${2:-127.0.0.1}
  [[ -n "$DIR" ]] || die "usage: s3.sh up DIR [BIND]"
  [[ -x "$BIN/weed" ]] || cmd_build >&2
  mkdir -p "$DIR/data" && DIR=$(cd "$DIR" && pwd)
  [[ -e "$DIR/pid" ]] && die "$DIR/pid exists: a server runs there ('s3.sh down $DIR')"
  [[ -s "$DIR/env" ]] || write_env
  # shellcheck disable=SC1091
  . "$DIR/env"
  "$BIN/weed" server -ip=127.0.0.1 -ip.bind="$bind" -dir="$DIR/data" \
    -master.port="$MASTER_PORT" -volume.port="$VOLUME_PORT" -filer -filer.port="$FILER_PORT" \
    -s3 -s3.port="$S3_PORT" -s3.config="$DIR/s3.json" -master.volumeSizeLimitMB=256 \
    -volume.max=0 -volume.preStopSeconds=0 >"$DIR/weed.log" 2>&1 &
  echo $! >"$DIR/pid"
  for _ in $(seq 600); do
    kill -0 "$(cat "$DIR/pid")" 2>/dev/null || { tail -30 "$DIR/weed.log" >&2; rm -f "$DIR/pid"; die "weed exited"; }
    # Any HTTP answer from the S3 port (403 for an anonymous request) means the gateway serves.
    if curl -s -o /dev/null -w '%{http_code}' "$ENDPOINT/" 2>/dev/null | grep -q '^[1-5]'; then
      echo "s3.sh: serving $ENDPOINT (state in $DIR)"
      return
    fi
    sleep 0.1
  done
  cmd_down "$DIR" >/dev/null
  die "the S3 gateway did not answer on $ENDPOINT in 60 s (see $DIR/weed.log)"
}

cmd_down() {
  local dir=${1:-} pid
  [[ -n "$dir" ]] || die "usage: s3.sh down DIR"
  [[ -f "$dir/pid" ]] || { echo "s3.sh: nothing runs in $dir"; return 0; }
  pid=$(cat "$dir/pid")
  # A pid that no longer runs weed (the process ended, the pid was reused) is left alone.
  if [[ "$(readlink "/proc/$pid/exe" 2>/dev/null)" == */weed ]]; then
    kill -TERM "$pid" 2>/dev/null || true
    # weed's volume server and filer close their stores within a moment of SIGTERM (up's
    # -volume.preStopSeconds=0: no 10 s wait for a master that stops with them), but the
    # process itself then hangs in the rest of its shutdown (weed of 2026-11): once both have
    # said so it is killed, as it is after 10 s in any case.
    for _ in $(seq 100); do
      kill -0 "$pid" 2>/dev/null || break
      grep -q "Shutting down filer" "$dir/weed.log" 2>/dev/null \
        && grep -q "Shut down successfully" "$dir/weed.log" && break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    echo "s3.sh: stopped weed ($pid)"
  fi
  rm -f "$dir/pid"
}

case ${1:-} in
  build) cmd_build ;;
  up) shift; cmd_up "$@" ;;
  down) shift; cmd_down "$@" ;;
  bin) echo "$BIN" ;;
  *) die "usage: s3.sh build | up DIR [BIND] | down DIR | bin" ;;
esac
