#!/usr/bin/env bash
# Make a Debian machine ready to build and run ftjob's images with podman (the image tests,
# tests/images/, need it; the README's test command runs this first), and give it ip for the
# Kueue cluster tests. Idempotent.
#
#   bash scripts/podman-host.sh
#
# Installs podman, runc and debootstrap (debootstrap makes the stand-in base images, see
# scripts/images.sh), containerd and the CNI plugins (the real nodes, scripts/nodes.sh) and,
# if the machine has no /etc/containers/containers.conf yet, writes one with the three settings
# podman needs on CI machines of this project's kind:
# - runtime "runc": crun refuses the machine's hybrid (v1 + v2) cgroup hierarchy;
# - cgroup_manager "cgroupfs": there is no systemd to ask for cgroups;
# - default_ulimits = []: containers may not set RLIMIT_NPROC/NOFILE there, and podman's
#   defaults do.
# And it turns on net.ipv4.ip_forward: the real nodes' pods reach each other through this host,
# which routes between the nodes' bridges (podman turns it on too, but only once it starts a
# container on its own bridge, which no test may have done before the real nodes come up).
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"  # runc and debootstrap live in sbin
need=()
for pkg in podman runc debootstrap; do  # each package is named for its command
  command -v "$pkg" >/dev/null || need+=("$pkg")
done
# ip (iproute2): the Kueue cluster tests serve Kueue's webhook on a veth pair into a network
# namespace (scripts/kueue.sh), as root.
command -v ip >/dev/null || need+=(iproute2)
# containerd (with ctr) and the CNI plugins: the real nodes of the cluster tests
# (scripts/nodes.sh); runc above is their runtime too.
command -v containerd >/dev/null || need+=(containerd)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
if [ ${#need[@]} -gt 0 ]; then
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "podman-host: installing ${need[*]} (apt-get)"
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

conf=/etc/containers/containers.conf
if [ ! -e "$conf" ]; then
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" mkdir -p /etc/containers
  "${sudo[@]}" tee "$conf" >/dev/null <<'EOF'
# Written by ftjob's scripts/podman-host.sh (see there for why).
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
  echo "podman-host: wrote $conf"
elif ! grep -Eq '^[[:space:]]*default_ulimits[[:space:]]*=[[:space:]]*\[[[:space:]]*\]' "$conf"; then
  echo "podman-host: $conf exists without 'default_ulimits = []' in [containers];" \
    "containers may fail to start where setting RLIMIT_NPROC/NOFILE is refused" >&2
fi
if [ "$(cat /proc/sys/net/ipv4/ip_forward)" != 1 ]; then
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" sysctl -q -w net.ipv4.ip_forward=1
  echo "podman-host: net.ipv4.ip_forward=1 (the real nodes route between their bridges)"
fi
podman --version
