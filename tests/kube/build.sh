#!/usr/bin/env bash
# Builds the Kubernetes programs the Kubernetes tests run (tests/kube/README.md) from the Go
# module proxy, once per set of versions: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and kubectl (gomod/: k8s.io/kubernetes with its staging modules pinned), the
# KubeRay operator and its CRDs (github.com/ray-project/kuberay/ray-operator), and the node
# runner's streaming server (gomod/streams). Prints the directory that holds them:
#     $RLHF_TASKS_KUBE_CACHE (default ~/.cache/rlhf-tasks/kube)/<key>/{bin,crd}
# <key> hashes this script, versions.env, Go's version and the module's go.mod/go.sum, so a
# second run builds nothing; kube-streams is rebuilt (seconds) when its source changes.
#
# `build.sh --background` starts the build at the lowest CPU priority and returns at once, printing
# where its output goes (<key>.log beside the build; nothing when built or being built): `make test` overlaps the cold build with the tests that
# need none of it. One build at a time holds <key>.lock; a second build.sh waits for it and
# then finds the programs built.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
. "$here/versions.env"
command -v go >/dev/null || { echo "build.sh: the Kubernetes tests need Go (go not on PATH)" >&2; exit 2; }
key="$(cat "$0" "$here/versions.env" "$here/gomod/go.mod" "$here/gomod/go.sum" <(go env GOVERSION) \
       | sha256sum | cut -c1-16)"
out="${RLHF_TASKS_KUBE_CACHE:-$HOME/.cache/rlhf-tasks/kube}/$key"
mkdir -p "$(dirname "$out")"
if [ "${1:-}" = --background ]; then
  if [ ! -f "$out/.done" ] && flock -n "$out.lock" true; then  # neither built nor being built
    echo "build.sh: building the Kubernetes tests' programs in the background, at nice 19 (log: $out.log)" >&2
    nohup nice -n 19 bash "$0" >"$out.log" 2>&1 </dev/null &
    echo "$out.log"
  fi
  exit 0
fi
exec 9>"$out.lock"
if ! flock -n 9; then
  echo "build.sh: waiting for the build already under way ($out.log)" >&2
  flock 9
fi
start=$SECONDS
say() { echo "build.sh: $* ($((SECONDS - start)) s)" >&2; }
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
if [ ! -f "$out/.done" ]; then
  mkdir -p "$out/bin" "$out/crd"
  say "building Kubernetes $KUBERNETES_VERSION and etcd $ETCD_VERSION into $out/bin (cold: 7-10 minutes on 2 cores measured here, more under load)"
  # the version the programs report (/version, kubectl version), as Kubernetes' own build stamps it
  v="${KUBERNETES_VERSION#v}"
  stamp=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=${v%%.*} -X $pkg.gitMinor=$(cut -d. -f2 <<<"$v")"
    stamp+=" -X $pkg.gitTreeState=clean"
  done
  (cd "$here/gomod" && go build -trimpath -ldflags="-s$stamp" -o "$out/bin/" \
     go.etcd.io/etcd/server/v3 k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
     k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
  mv "$out/bin/server" "$out/bin/etcd"  # go names go.etcd.io/etcd/server/v3's binary after "server"
  say "building the KubeRay operator $KUBERAY_VERSION"
  GOBIN="$out/bin" go install -trimpath -ldflags=-s "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
  cp "$(go env GOMODCACHE)/github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"/config/crd/bases/*.yaml \
     "$out/crd/"
  chmod -R u+w "$out/crd"
  touch "$out/.done"
  say "built"
fi
streams="$(cat "$here"/gomod/streams/*.go | sha256sum | cut -c1-16)"
if [ ! -x "$out/bin/kube-streams-$streams" ]; then
  (cd "$here/gomod" && go build -trimpath -ldflags=-s -o "$out/bin/kube-streams-$streams" ./streams)
  ln -sfn "kube-streams-$streams" "$out/bin/kube-streams"
fi
echo "$out"
