"""The local node agent: an honest stand-in for kubelet plus a container runtime.

There is no container runtime on the development machine, so each container runs as a host process
in the agent's Python environment (the image is recorded, never pulled), in its own session and in a
private mount + UTS namespace where the pod's volumes (service-account token, secrets, config maps,
emptyDir, downward API, hostPath) and the termination-message file are bind-mounted at their
`volumeMounts` paths. Everything else a pod observes goes through the real API: the Node and its
Lease, the pod `status` subresource, TokenRequest, Events, and `kubectl logs` through the API
server's kubelet proxy.

Modules: `agent` (node registration, heartbeats, the pod watch), `runtime` (one PodWorker per pod:
volumes, processes, restarts, deletion, status), `podspec` (pure: env, volume payloads, status),
`spawn` (the helper that sets up a container's namespace and execs it), `server` (the HTTPS
endpoint), `kubeapi` (the few API calls, on aiohttp).

Differences from kubelet, by design or for now:

- No images: `command` is required (there is no ENTRYPOINT to fall back to); PATH is the agent's, with
  its Python environment's bin first. For a non-root `runAsUser` the agent's Python environment is
  made reachable read-only (a tmpfs over a closed ancestor such as a 0700 /root, holding only the
  environment), as an image would ship it; the rest of the host filesystem is as the host has it.
- Pods share the host network: podIP is 127.0.0.1, ports can collide; only the KUBERNETES_SERVICE_*
  service variables are injected.
- Mount points that do not exist on the host are created there as empty directories or files (e.g.
  /var/run/secrets/kubernetes.io/serviceaccount, /dev/termination-log); their content stays private.
- emptyDir is disk-backed whatever its medium; sizeLimit and resource limits are not enforced.
- Secret and ConfigMap volumes are written at pod start and not refreshed; projected tokens are.
- Probes and lifecycle hooks are not run: a running container is ready. exec, attach and
  port-forward answer 501.
- `kubectl logs` supports follow, previous, tailLines and limitBytes, not timestamps or sinceTime.
  The endpoint authorizes by client certificate (the API server's kubelet client, system:masters)
  rather than by SubjectAccessReview.
- Containers die with the agent (parent-death signal); a restarted agent reports them as
  ContainerStatusUnknown and applies the restart policy. On SIGTERM the agent stops its pods as
  kubelet's graceful node shutdown does (phase Failed, reason Terminated).

Run as `python -m flowkube_devstack.node ...`; `cluster.LocalCluster` starts it.
"""
