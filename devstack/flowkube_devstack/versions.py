"""Pinned versions of everything the local stack builds from source.

Kubernetes 1.36.x is the newest minor that builds with the machine's Go 1.26 and that the
kopf/kubernetes clients we pin talk to; etcd 3.6.x is the series Kubernetes 1.36 is tested with.
Bumping a version here changes the cache key, so the next run rebuilds exactly once.
"""

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
HELM_VERSION = "v3.21.4"
# The cluster DNS of the local node: the release series Kubernetes 1.36 ships with kubeadm.
COREDNS_VERSION = "v1.15.0"
# kind, built from its Go module for hack/kind-e2e.sh: the newest release, and the first to know Kubernetes 1.36.
KIND_VERSION = "v0.33.0"
# Jaeger, the local stack's trace backend (OTLP in, its query API out), from its Go module: the
# newest release the module proxy serves (the v1 module path carries the v2 binary: v1.76.0 = v2.13.0).
JAEGER_VERSION = "v1.76.0"
