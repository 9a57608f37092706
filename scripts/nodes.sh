# Real nodes on scripts/k8s.sh's control plane: kubelet v$KUBE_VERSION + containerd, each node
# its own pair of processes. Sourced by k8s.sh (`build --nodes`, `up DIR --nodes N`, `down DIR`),
# which provides DIR, BIN, CACHE, STAGING, start, wait_healthy, kubectl_, free_port, cert, die.
#
#   build --nodes     kubelet from the plane's own local module (the same replaces, the same
#                     GOPATH/GOCACHE, so a warm plane build makes it ~30 s), CoreDNS from its
#                     module (`go install`, the same caches) and the pause image (a static Go
#                     program in an image from scratch, saved to the cache)
#   up DIR --nodes N  real-node-0..N-1 (label ftjob.dev/real-node=true): under DIR/nodes/NAME
#                     a containerd (root, state, socket, CNI bridge and /24) and a kubelet
#                     (root dir, pod logs, ports, cgroup root /ftjob-ID-NAME) as the node itself
#                     (system:node:NAME); the images named by --node-image (repeatable; default
#                     scripts/images.sh's two at FTJOB_IMAGE_TAG, else dev) imported into node
#                     0's containerd (`podman save | ctr import`) and given to the others as
#                     hard links (nodes_share_images), node 0 too when the images' cache holds
#                     these images (nodes_cached); when it holds older ones, node 0 gets those
#                     and is sent only the layers it lacks (nodes_import_delta: a change to
#                     ftjob/ sends the trainer image's top layers, not 6 GB); the cluster's
#                     DNS (CoreDNS, a process);
#                     returns when every node is Ready
#   down DIR          every container killed and removed, then kubelet, containerd and CoreDNS
#                     stopped, mounts, network namespaces, bridges and cgroups removed, and
#                     containerd's root (the images' cache keeps its own links to them)
#
# Containerd and runc are Debian's (scripts/podman-host.sh installs them with apt-get); the
# CNI plugins are Debian's containernetworking-plugins.
#
# Pod network: node K's pods are on its bridge ftjnK, 10.214.K.0/24, gateway 10.214.K.1 (this
# host). Pods of two nodes reach each other through the host, which routes between its bridges
# as between any two of its connected networks: that takes net.ipv4.ip_forward=1 (`up` checks,
# and says the fix; it changes no machine-wide setting) and a FORWARD chain that does not drop
# them. `up` adds no iptables rule and no route (the bridges' own /24s are the routes), and the
# kubelet's makeIPTablesUtilChains is off, so it adds none either: `down` has none to remove.
#
# Cluster DNS: CoreDNS as a process of the plane, its kubernetes plugin watching the plane as
# system:coredns (a certificate and a ClusterRole of list/watch), answering on node 0's gateway
# address, port 53, which every pod reaches (its own node's gateway, or through it). The
# kubelets' clusterDNS names that address, so a pod's resolv.conf searches
# NS.svc.cluster.local and a gang's `pod.job.ns.svc` resolves to the pod's address. There is
# no kube-dns Service: with no kube-proxy here a cluster IP leads nowhere, and nothing reads
# the Service. No upstream is forwarded to: pods here need cluster names only. The reverse zone
# too: torch's c10d store looks up its clients' addresses (a warning per client without it).
#
# ---- What this machine's kind needs, and why (the one place that says it) ----------------------
# - cgroup v1 (a hybrid hierarchy, no systemd): the kubelet's cgroupDriver is cgroupfs and
#   failCgroupV1 false (v1.35+ refuses v1 otherwise); containerd's runc runs SystemdCgroup=false.
# - swap may be on: failSwapOn false.
# - containerd 1.6 reports image-filesystem capacity 0, and the kubelet's default eviction
#   thresholds then see DiskPressure and taint the node: evictionHard is set low, every signal.
# - CAP_SYS_RESOURCE is withheld: runc fails ("can't get final child's PID from pipe: EOF") when
#   a bundle lowers oom_score_adj (the CRI gives the sandbox -998, a Guaranteed pod's container
#   -997). containerd's restrict_oom_score_adj keeps every score at or above containerd's own
#   (0 here): BestEffort and Burstable pods keep the kubelet's scores, Guaranteed ones get 0.
#   (The CRI sets no rlimits: pods inherit containerd's, so none needs raising.)
# - a kubelet refuses a loopback node IP: each node's InternalIP is its bridge's gateway address
#   (10.214.K.1, made at `up`, reachable from this host only), where its kubelet listens.
# - the apiserver reaches a kubelet (kubectl logs/exec) at that InternalIP rather than at the
#   node's name, which does not resolve, with a client certificate the kubelet's webhook
#   authorization accepts: nodes_apiserver_args.
# -------------------------------------------------------------------------------------------------

NODES_PAUSE="localhost/ftjob-pause:1"
NODES_DNS_VERSION=1.15.0
NODES_DNS_BIN="${FTJOB_K8S_CACHE:-$HOME/.cache/ftjob/k8s}/coredns-v$NODES_DNS_VERSION/bin"
NODES_DOMAIN=cluster.local
NODES_NET_LOCK="${TMPDIR:-/tmp}/ftjob-nodes-net.lock"
# Node 0's imported images, kept between runs (nodes_cached), one entry per set of images.
NODES_IMAGE_CACHE="${FTJOB_K8S_CACHE:-$HOME/.cache/ftjob/k8s}/node-images"
NODES_IMAGE_CACHE_KEEP=2 # the tests' two sets: the operator image, the trainer image
export PATH="$PATH:/usr/sbin:/sbin"

# The apiserver's flags for real nodes (see the header), appended to k8s.sh's APISERVER_ARGS.
nodes_apiserver_args() {
  APISERVER_ARGS+=(--kubelet-preferred-address-types=InternalIP
    "--kubelet-client-certificate=$DIR/pki/admin.crt" "--kubelet-client-key=$DIR/pki/admin.key")
}

nodes_built() { [[ -x "$BIN/kubelet" && -x "$NODES_DNS_BIN/coredns" && -s "$CACHE/pause.tar" ]]; }

nodes_kubelet_module() {
  printf 'module ftjob.dev/kubelet\n\ngo %s\n\nrequire k8s.io/kubernetes v%s\n\n' \
    "$GO_DIRECTIVE" "$KUBE_VERSION"
  for m in "${STAGING[@]}"; do echo "replace k8s.io/$m => k8s.io/$m v$STAGING_VERSION"; done
  printf '\ntool k8s.io/kubernetes/cmd/kubelet\n'
}

# A module of its own beside the plane's (whose go.sum lacks the kubelet's extra modules), with
# the same requirement and replaces: the same versions of everything the two share.
nodes_build_kubelet() {
  local src="$CACHE/src/kubelet" v="k8s.io/component-base/version"
  mkdir -p "$src" && nodes_kubelet_module >"$src/go.mod"
  (cd "$src" && go mod tidy)
  local flags="-s -w -X $v.gitVersion=v$KUBE_VERSION -X $v.gitMajor=${KUBE_VERSION%%.*}"
  flags+=" -X $v.gitMinor=$(echo "$KUBE_VERSION" | cut -d. -f2) -X $v.gitTreeState=clean"
  flags+=" -X $v.buildDate=1970-01-01T00:00:00Z"
  (cd "$src" && go build -trimpath -ldflags "$flags" -o "$BIN/" k8s.io/kubernetes/cmd/kubelet)
}

# The sandbox image: what Kubernetes' pause does (sleep until a signal, reap orphans), in Go,
# static, in an image from scratch, saved as an archive that `ctr import` takes.
nodes_build_pause() {
  local src="$CACHE/src/pause"
  mkdir -p "$src"
  printf 'module ftjob.dev/pause\n\ngo %s\n' "$GO_DIRECTIVE" >"$src/go.mod"
  cat >"$src/main.go" <<'EOF'
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 8)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for { // reap every exited orphan
			if pid, _ := syscall.Wait4(-1, nil, syscall.WNOHANG, nil); pid <= 0 {
				break
			}
		}
	}
}
EOF
  printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$src/Containerfile"
  (cd "$src" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o pause .)
  podman build -q -t "$NODES_PAUSE" "$src" >/dev/null
  podman save "$NODES_PAUSE" >"$CACHE/pause.tar.new" && mv "$CACHE/pause.tar.new" "$CACHE/pause.tar"
}

nodes_build() {
  if nodes_built; then echo "nodes.sh: cached in $BIN"; return; fi
  command -v go >/dev/null || die "go is not installed (it builds the kubelet)"
  command -v podman >/dev/null || die "podman is not installed (scripts/podman-host.sh)"
  [[ -x "$BIN/kubelet" ]] || nodes_build_kubelet
  # CoreDNS's go.mod has no replaces: `go install` of the published module is enough.
  [[ -x "$NODES_DNS_BIN/coredns" ]] || GOBIN="$NODES_DNS_BIN" GOFLAGS=-trimpath \
    go install -ldflags "-s -w" "github.com/coredns/coredns@v$NODES_DNS_VERSION"
  [[ -s "$CACHE/pause.tar" ]] || nodes_build_pause
  nodes_built || die "the nodes' build left no kubelet or pause image in $BIN"
  echo "nodes.sh: built kubelet, CoreDNS and the pause image"
}

# ------------------------------------------------------------------------------------ up

# nodes_containerd_config NODEDIR
nodes_containerd_config() {
  local d=$1
  cat <<EOF
version = 2
root = "$d/containerd/root"
state = "$d/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$d/containerd.sock"
[ttrpc]
  address = "$d/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$NODES_PAUSE"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni"
EOF
}

# nodes_cni NODEDIR SUBNET BRIDGE: a bridge with the node's /24, no masquerade (no iptables);
# the pods' default route is the bridge's gateway (this host), which routes to the other nodes.
nodes_cni() {
  cat <<EOF
{"cniVersion": "1.0.0", "name": "$3", "plugins": [
  {"type": "bridge", "bridge": "$3", "isDefaultGateway": true, "ipMasq": false,
   "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$2"}]], "dataDir": "$1/ipam"}},
  {"type": "loopback"}]}
EOF
}

# nodes_kubelet_config NODEDIR NAME PORT HEALTHZ IP (and NODES_DNS_IP: the cluster's DNS)
nodes_kubelet_config() {
  cat <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $5
port: $3
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $4
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $DIR/pki/$2.crt
tlsPrivateKeyFile: $DIR/pki/$2.key
containerRuntimeEndpoint: unix://$1/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: /$(nodes_cgroup "$2")
failCgroupV1: false
failSwapOn: false
podLogsDir: $1/pod-logs
volumePluginDir: $1/volume-plugins
registerNode: true
evictionHard: {memory.available: 50Mi, nodefs.available: 1%, nodefs.inodesFree: 1%,
  imagefs.available: 1%, imagefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
clusterDNS: [$NODES_DNS_IP]
clusterDomain: $NODES_DOMAIN
makeIPTablesUtilChains: false
EOF
}

# A cgroup name unique to this plane and node (two planes on one machine never share one).
nodes_cgroup() { echo "ftjob-$(echo "$DIR" | md5sum | cut -c1-8)-$1"; }

# nodes_subnet: a 10.214.K.0/24 no route of this machine uses yet (under a lock: two planes
# starting at once take different ones); prints "K".
nodes_free_subnet() {
  local k
  for k in $(seq 0 255); do
    ip route | grep -q "^10\.214\.$k\.0/24 " && continue
    grep -qs "^10.214.$k$" "${TMPDIR:-/tmp}"/ftjob-nodes-net.taken && continue
    echo "10.214.$k" >>"${TMPDIR:-/tmp}/ftjob-nodes-net.taken"
    echo "$k"
    return
  done
  die "no free 10.214.K.0/24 for a node's pods"
}

# nodes_import NODEDIR: the pause image and the test images into the node's containerd, then
# the archive's layer blobs dropped (the blobs labelled with their uncompressed digest, which
# only layers carry). Containers run from the unpacked snapshots, and the kubelet reads only
# an image's manifest and config, which stay (a pod ran with the blobs gone): a node then holds
# one copy of the trainer image, not two (5.6 GB of blobs beside its 5.7 GB snapshot).
nodes_import() {
  local ctr=(ctr -a "$1/containerd.sock" -n k8s.io) ref
  "${ctr[@]}" images import "$CACHE/pause.tar" >/dev/null
  for ref in "${NODE_IMAGES[@]}"; do
    podman image exists "$ref" || die "image $ref is not in podman (bash scripts/images.sh)"
    if $NODES_BASED; then
      nodes_import_delta "$1" "$ref" && continue
      echo "nodes.sh: sending only $ref's new layers failed; importing all of it" >&2
    fi
    podman save "$ref" | "${ctr[@]}" images import - >/dev/null
  done
  "${ctr[@]}" content ls | awk '/containerd.io\/uncompressed=/ {print $1}' |
    xargs -r "${ctr[@]}" content rm >/dev/null
}

# nodes_import_delta NODEDIR REF: REF into the node's containerd, sending only the layers it
# has no snapshot of (scripts/oci_delta.py: the image kept as an OCI folder in the cache,
# podman writing only the blobs that folder lacks). Given an earlier run's images
# (nodes_cache_base), a change to ftjob/ sends the trainer image's few top layers, not 6 GB.
nodes_import_delta() {
  local d=$1 ref=$2 ctr=(ctr -a "$1/containerd.sock" -n k8s.io) oci stale
  local delta snaps="$1/snapshots.ls"
  delta="$(dirname "${BASH_SOURCE[0]}")/oci_delta.py"
  oci="$NODES_IMAGE_CACHE/oci/${ref//[\/:]/_}"
  mkdir -p "$oci" && "${ctr[@]}" snapshots ls >"$snaps" || return 1
  # One image a folder: an index listing earlier saves would have containerd import them too.
  rm -f "$oci/index.json"
  podman save -q --format oci-dir --uncompressed -o "$oci" "$ref" || return 1
  # A blob made hollow by an earlier import that this node lacks: written again.
  stale=$(python3 "$delta" needs "$oci" "$snaps") || return 1
  if [[ -n "$stale" ]]; then
    xargs rm -f <<<"$stale"
    podman save -q --format oci-dir --uncompressed -o "$oci" "$ref" || return 1
  fi
  python3 "$delta" tar "$oci" "$snaps" | "${ctr[@]}" images import - >/dev/null &&
    python3 "$delta" hollow "$oci"
}

# nodes_has_images NODEDIR: whether the node's containerd lists every image of NODE_IMAGES.
nodes_has_images() {
  local listed ref
  listed=$(ctr -a "$1/containerd.sock" -n k8s.io images ls -q) || return 1
  for ref in "${NODE_IMAGES[@]}"; do
    grep -qx "$ref" <<<"$listed" || return 1
  done
}

# nodes_share_images FROM TO: node FROM's imported images given to node TO before TO's
# containerd starts. The unpacked layers (committed snapshots) are hard links: no container
# writes them (each writes its own upper directory, and overlayfs copies a file up before
# changing it), so the nodes share one copy on disk and one import. The two metadata
# databases (containerd's and the snapshotter's) are copies: each containerd writes its own.
# A real cluster's nodes each pull their own copy; on one machine that was 6 GB and minutes a
# node for bytes that are the same.
nodes_share_images() {
  local from=$1/containerd/root to=$2/containerd/root plugin
  mkdir -p "$to/io.containerd.metadata.v1.bolt"
  for plugin in io.containerd.snapshotter.v1.overlayfs io.containerd.content.v1.content; do
    cp -al "$from/$plugin" "$to/" || die "cannot link $from/$plugin into $to"
  done
  rm "$to/io.containerd.snapshotter.v1.overlayfs/metadata.db"
  cp "$from/io.containerd.snapshotter.v1.overlayfs/metadata.db" \
    "$to/io.containerd.snapshotter.v1.overlayfs/"
  cp "$from/io.containerd.metadata.v1.bolt/meta.db" "$to/io.containerd.metadata.v1.bolt/"
}

# nodes_images_key: what names the images a node gets: each --node-image's name and podman ID,
# and the pause archive's checksum. The same key is the same bytes, unpacked alike.
nodes_images_key() {
  local ref
  {
    for ref in "${NODE_IMAGES[@]}"; do
      echo "$ref $(podman image inspect --format '{{.Id}}' "$ref")"
    done
    cksum <"$CACHE/pause.tar"
  } | sha256sum | cut -c1-16
}

# nodes_cached NODEDIR: node 0 given the cache's copy of these images (hard links, as
# nodes_share_images gives node 0's to the others) before its containerd starts; fails when
# the cache has none. `podman save | ctr import` of the 6 GB trainer image took 150-190 s
# here, its layers already unpacked or not: it is the stream, not the unpacking.
nodes_cached() {
  local entry
  entry="$NODES_IMAGE_CACHE/$(nodes_images_key)"
  [[ -s "$entry/complete" ]] || return 1
  touch "$entry/complete" # the newest used are kept (nodes_cache_save)
  nodes_share_images "$entry" "$1"
}

# nodes_cache_base NODEDIR: node 0 given the newest images the cache holds (as nodes_cached
# does), when none is these images: their layers are snapshots nodes_import_delta sends no more.
nodes_cache_base() {
  local newest
  newest=$(ls -1t "$NODES_IMAGE_CACHE"/*/complete 2>/dev/null | head -1)
  [[ -n "$newest" ]] && nodes_share_images "$(dirname "$newest")" "$1"
}

# nodes_cache_save NODEDIR: node 0's images, just imported, into the cache (hard links and the
# two metadata databases, as nodes_share_images takes them); only the newest
# NODES_IMAGE_CACHE_KEEP entries stay: an entry is ~6 GB that the nodes' own copies share.
nodes_cache_save() {
  local key new old
  key=$(nodes_images_key)
  new="$NODES_IMAGE_CACHE/.$key.$$"
  mkdir -p "$NODES_IMAGE_CACHE"
  # Another run may have saved the same key first: then mv refuses, and this copy goes.
  nodes_share_images "$1" "$new" && echo "${NODE_IMAGES[*]}" >"$new/complete" &&
    mv -T "$new" "$NODES_IMAGE_CACHE/$key" 2>/dev/null
  rm -rf "$new"
  ls -1t "$NODES_IMAGE_CACHE"/*/complete 2>/dev/null | tail -n +$((NODES_IMAGE_CACHE_KEEP + 1)) |
    while read -r old; do rm -rf "$(dirname "$old")"; done
}

# nodes_disk: refuse to start nodes where DIR's disk cannot take their images: one unpacked
# copy (shared by the nodes), and the archive's blobs beside it while node 0 imports, until
# they are dropped. A full disk would otherwise surface as pods that never start.
nodes_disk() {
  local ref size=0 need free
  for ref in "${NODE_IMAGES[@]}"; do
    podman image exists "$ref" || die "image $ref is not in podman (bash scripts/images.sh)"
    size=$((size + $(podman image inspect --format '{{.Size}}' "$ref")))
  done
  need=$((2 * size / 1000000000 + 2)) # and 2 GB for the pods' writes and the logs
  free=$(($(df --output=avail -B1 "$DIR" | tail -1) / 1000000000))
  ((free >= need)) || die "real nodes need ~$need GB free under $DIR for their images" \
    "(${#NODE_IMAGES[@]} image(s), $((size / 1000000000)) GB unpacked); $free GB free"
}

# nodes_net_one NAME: the node's /24 and its bridge, made before any node starts: node 0's
# gateway address is where the cluster's DNS answers, and every kubelet names it. The bridge
# now, not at the first pod: its gateway address is the node's InternalIP too, where the
# kubelet listens (a kubelet refuses a loopback node IP), reachable from this host only.
nodes_net_one() {
  local d="$DIR/nodes/$1" k
  mkdir -p "$d/cni"
  k=$(flock "$NODES_NET_LOCK" bash -c "$(declare -f nodes_free_subnet die); nodes_free_subnet")
  echo "$k" >"$d/subnet"
  nodes_cni "$d" "10.214.$k.0/24" "ftjn$k" >"$d/cni/10-ftjob.conflist"
  ip link add "ftjn$k" type bridge && ip addr add "10.214.$k.1/24" dev "ftjn$k" &&
    ip link set "ftjn$k" up || die "cannot make bridge ftjn$k (needs root)"
}

nodes_start_one() {
  local name=$1 d="$DIR/nodes/$1" k port healthz ctl
  mkdir -p "$d/pod-logs" "$d/kubelet" "$d/volume-plugins"
  k=$(cat "$d/subnet")
  nodes_containerd_config "$d" >"$d/containerd.toml"
  local imported=false
  NODES_BASED=false
  if [[ "$name" != real-node-0 ]]; then
    nodes_share_images "$DIR/nodes/real-node-0" "$d"
  elif ! nodes_cached "$d"; then
    imported=true
    if nodes_cache_base "$d"; then NODES_BASED=true; fi
  fi
  start "containerd" containerd --config "$d/containerd.toml"
  for _ in $(seq 300); do [[ -S "$d/containerd.sock" ]] && break; sleep 0.1; done
  ctr -a "$d/containerd.sock" version >/dev/null || die "containerd of $name did not start"
  if $imported; then
    nodes_import "$d"
    nodes_cache_save "$d"
  else
    nodes_has_images "$d" || die "$name's containerd does not list the images it was given"
  fi
  # The node's identity: the Node authorizer gives system:node:NAME what a kubelet needs.
  cert "$name" "/O=system:nodes/CN=system:node:$name" \
    "subjectAltName=IP:10.214.$k.1,DNS:$name"$'\n'"extendedKeyUsage=clientAuth,serverAuth"
  kubeconfig "$name" "$name"
  # The kubelet wants its cgroup root to exist in every v1 hierarchy.
  for ctl in /sys/fs/cgroup/*/; do
    [[ -e "$ctl/cgroup.procs" ]] && mkdir -p "$ctl$(nodes_cgroup "$name")"
  done
  port=$(free_port) healthz=$(free_port)
  nodes_kubelet_config "$d" "$name" "$port" "$healthz" "10.214.$k.1" >"$d/kubelet.yaml"
  start kubelet "$BIN/kubelet" --config "$d/kubelet.yaml" --kubeconfig "$DIR/$name.kubeconfig" \
    --root-dir "$d/kubelet" --cert-dir "$d/kubelet/pki" --hostname-override "$name" \
    --node-ip "10.214.$k.1" --node-labels "ftjob.dev/real-node=true"
  wait_healthy kubelet "http://127.0.0.1:$healthz/healthz"
}

# What CoreDNS's kubernetes plugin reads, and no more.
nodes_dns_rbac() {
  cat <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}]
EOF
}

# nodes_dns: CoreDNS on NODES_DNS_IP:53 (see the header), ready once its kubernetes plugin
# has synced with the plane.
nodes_dns() {
  local ready
  ready=$(free_port)
  cert coredns "/CN=system:coredns" "extendedKeyUsage=clientAuth"
  kubeconfig coredns coredns
  nodes_dns_rbac | kubectl_ apply -f - >/dev/null
  cat >"$DIR/Corefile" <<EOF
.:53 {
    bind $NODES_DNS_IP
    errors
    ready 127.0.0.1:$ready
    kubernetes $NODES_DOMAIN in-addr.arpa {
        kubeconfig $DIR/coredns.kubeconfig ftjob-test
    }
}
EOF
  start coredns "$NODES_DNS_BIN/coredns" -conf "$DIR/Corefile"
  wait_healthy coredns "http://127.0.0.1:$ready/ready"
}

nodes_up() {
  local n=$1 i
  nodes_built || die "no kubelet in $BIN: run 'scripts/k8s.sh build --nodes' first"
  command -v containerd >/dev/null || die "containerd is not installed (scripts/podman-host.sh)"
  if [[ ${#NODE_IMAGES[@]} -eq 0 ]]; then
    NODE_IMAGES=("localhost/ftjob-operator:${FTJOB_IMAGE_TAG:-dev}"
      "localhost/ftjob-trainer:${FTJOB_IMAGE_TAG:-dev}")
  fi
  [[ "$(cat /proc/sys/net/ipv4/ip_forward)" == 1 ]] ||
    die "pods of two nodes need this host to route: sysctl -w net.ipv4.ip_forward=1" \
      "(scripts/podman-host.sh does)"
  nodes_disk
  for ((i = 0; i < n; i++)); do nodes_net_one "real-node-$i"; done
  NODES_DNS_IP="10.214.$(cat "$DIR/nodes/real-node-0/subnet").1"
  nodes_dns
  for ((i = 0; i < n; i++)); do nodes_start_one "real-node-$i"; done
  for ((i = 0; i < n; i++)); do
    # `kubectl wait` fails at once on a Node not registered yet: wait for the object first.
    for _ in $(seq 600); do
      kubectl_ get "node/real-node-$i" >/dev/null 2>&1 && break
      sleep 0.1
    done
    kubectl_ wait --for=condition=Ready "node/real-node-$i" --timeout=120s >/dev/null ||
      die "real-node-$i is not Ready: $DIR/logs/kubelet.log"
  done
}

# ------------------------------------------------------------------------------------ down

# nodes_clear NODEDIR: every container of the node's containerd killed and deleted (their shims
# exit), the network namespaces the sandboxes had unmounted and removed (their veths go too).
nodes_clear() {
  local d=$1 c ns
  local ctr=(ctr -a "$d/containerd.sock" -n k8s.io)
  [[ -S "$d/containerd.sock" ]] || return 0
  # Each step may find its work done already (a task that exited): none is an error.
  for c in $("${ctr[@]}" containers list -q 2>/dev/null || true); do
    ns=$("${ctr[@]}" containers info "$c" 2>/dev/null | python3 -c '
import json, sys
spec = json.load(sys.stdin).get("Spec") or {}
for n in spec.get("linux", {}).get("namespaces", []):
    if n.get("type") == "network" and n.get("path"):
        print(n["path"])' 2>/dev/null || true)
    "${ctr[@]}" tasks kill -s KILL "$c" >/dev/null 2>&1 || true
    for _ in $(seq 50); do
      "${ctr[@]}" tasks delete "$c" >/dev/null 2>&1 && break
      "${ctr[@]}" tasks list -q 2>/dev/null | grep -qx "$c" || break
      sleep 0.1
    done
    "${ctr[@]}" containers delete "$c" >/dev/null 2>&1 || true
    # A sandbox's is a file containerd made (/var/run/netns/cni-...); a container's is the
    # sandbox process's (/proc/PID/ns/net), which goes with it.
    if [[ "$ns" == */netns/cni-* && -e "$ns" ]]; then
      umount "$ns" 2>/dev/null || true
      rm -f "$ns"
    fi
  done
}

# nodes_down DIR: after the processes are stopped (k8s.sh down): mounts, bridges, cgroups.
nodes_down_rest() {
  local dir=$1 d k m ctl cg
  for d in "$dir"/nodes/*/; do
    [[ -d "$d" ]] || continue
    # Mounts under the node's folders (snapshots, shm, projected volumes), deepest first.
    for m in $(awk '{print $5}' /proc/self/mountinfo | grep "^${d%/}/" | sort -r); do
      umount "$m" 2>/dev/null || umount -l "$m"
    done
    # containerd's root and state (links to the images' cache, and what the pods wrote).
    grep -q " ${d%/}/" /proc/self/mountinfo || rm -rf "$d/containerd"
    if [[ -s "$d/subnet" ]]; then
      k=$(cat "$d/subnet")
      ip link delete "ftjn$k" 2>/dev/null || true
      flock "$NODES_NET_LOCK" sed -i "/^10\.214\.$k$/d" "${TMPDIR:-/tmp}/ftjob-nodes-net.taken"
      rm -f "$d/subnet"
    fi
    cg=$(DIR=$dir nodes_cgroup "$(basename "$d")")
    for ctl in /sys/fs/cgroup/*/; do
      [[ -d "$ctl$cg" ]] && find "$ctl$cg" -depth -type d -exec rmdir {} + 2>/dev/null
    done
  done
  return 0
}
