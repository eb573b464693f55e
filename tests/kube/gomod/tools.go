//go:build tools

// Package tools names the main packages built here, so that `go mod tidy` keeps them.
package tools

import (
	_ "k8s.io/cri-streaming/pkg/streaming/portforward"
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
