#!/usr/bin/env bash
# End to end on kind, with Docker or podman: a cluster, both images built and loaded, the chart
# installed, a flow that asks for feedback answered with the raw status patch, usage and /metrics.
#
#   hack/kind-e2e.sh                          # the stub model answers (no API key needed)
#   OPENAI_API_KEY=sk-... hack/kind-e2e.sh    # a real model; the key goes into the Flow's Secret
#   KEEP_CLUSTER=1 hack/kind-e2e.sh           # leave the cluster for poking around
#   CLUSTER=NAME TIMEOUT=SECONDS KUBECTL=PATH HELM=PATH   # other knobs (defaults: flowkube-e2e, 300, built here)
#
# Needs Docker (its daemon running) or podman, Go and Python 3.11; kind, kubectl and helm are built
# from their Go modules and cached (./dev bootstraps the rest). The node image: kind's stock one with
# Docker when its registry is reachable; otherwise one assembled here for the pinned Kubernetes
# version, with the project's images from the local stack's build (no registry needed). NODE_IMAGE=stock
# or NODE_IMAGE=local chooses; KIND_EXPERIMENTAL_PROVIDER=docker|podman chooses the engine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CLUSTER=${CLUSTER:-flowkube-e2e}
NAMESPACE=${NAMESPACE:-flowkube-system}
FLOW_FILE=${FLOW_FILE:-examples/flows/inline-feedback.yaml}
TIMEOUT=${TIMEOUT:-300}    # seconds, for each wait
METRICS_PORT=${METRICS_PORT:-19090}
STUB_MODEL=${STUB_MODEL:-$([[ -n ${OPENAI_API_KEY:-} ]] && echo 0 || echo 1)}
KUBECONFIG=${KIND_KUBECONFIG:-${XDG_CACHE_HOME:-$HOME/.cache}/flowkube/kind/$CLUSTER.kubeconfig}
export KUBECONFIG

started=$SECONDS
figures=()
current_step="start"
failed_command=""
step() { current_step=$*; echo; echo "=== $* ($((SECONDS - started)) s)"; }
# The command that made the script fail (set -e), for the first line of the failure report. A
# command that says why itself (a `kind-e2e: ...` line on stderr) sets `why` before it exits.
why=""
trap 'failed_command=$BASH_COMMAND failed_line=$LINENO' ERR
set -o errtrace
fail() { why=$*; echo "kind-e2e: $*" >&2; exit 1; }
note() { echo "kind-e2e: $*"; }
timed() {  # timed LABEL CMD...: run CMD, keep its wall time for the summary
  local label=$1 t0=$SECONDS
  shift
  "$@"
  figures+=("$label: $((SECONDS - t0)) s")
}

# --- prerequisites and choices (./dev bootstraps Python; kind, kubectl, helm are built once) -------
[[ -x ./dev ]] || { echo "kind-e2e: run from a checkout of the repository (./dev is missing)" >&2; exit 1; }
step "prerequisites"
env_out=$(./dev kind env) || exit 1
set -a
eval "$env_out"   # PROVIDER NODE_IMAGE KIND KUBECTL HELM (+ podman's CONTAINERS_* and kind's provider)
set +a
kubectl() { "$KUBECTL" "$@"; }
note "provider $PROVIDER; kind $("$KIND" version | cut -d' ' -f2); kubectl and helm: $(dirname "$KUBECTL"), $(dirname "$HELM")"
NODE="$CLUSTER-control-plane"
figures+=("kind, kubectl, helm (built or cached): $TOOLS_SECONDS s")

created=0
port_forward=""
stop_port_forward() {
  [[ -n $port_forward ]] || return 0
  kill "$port_forward" 2>/dev/null || true
  wait "$port_forward" 2>/dev/null || true
  port_forward=""
}
cleanup() {
  local rc=$?
  stop_port_forward
  if [[ $rc -ne 0 ]]; then
    # What failed comes first (the test's assertion message starts from these lines); the
    # diagnostics of the cluster follow.
    echo "=== failed (exit $rc) after $((SECONDS - started)) s" >&2
    echo "kind-e2e: FAILED in step \"$current_step\": ${why:-\`$failed_command\` (line ${failed_line:-?}) exited $rc}" >&2
  fi
  if [[ $rc -ne 0 && $created == 1 ]]; then
    echo "=== diagnostics" >&2
    echo "--- Flows" >&2
    kubectl get flows -A -o wide >&2 || true
    kubectl get flows -A -o jsonpath='{range .items[*]}{.metadata.name}: {.status}{"\n"}{end}' >&2 || true
    echo "--- events" >&2
    kubectl get events -A --sort-by=.lastTimestamp >&2 || true
    echo "--- pods" >&2
    kubectl get pods -A -o wide >&2 || true
    echo "--- operator log" >&2
    kubectl -n "$NAMESPACE" logs deployment/flowkube --all-containers --tail=200 >&2 || true
  fi
  if [[ $created == 1 ]]; then
    if [[ ${KEEP_CLUSTER:-0} == 1 ]]; then
      echo "kind-e2e: kept cluster $CLUSTER: export KUBECONFIG=$KUBECONFIG PATH=$(dirname "$KUBECTL"):\$PATH" >&2
      [[ $PROVIDER == podman ]] && echo "kind-e2e: (podman: export CONTAINERS_CONF=$CONTAINERS_CONF" \
        "CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF; delete with $KIND delete cluster --name $CLUSTER)" >&2
    else
      local t0=$SECONDS
      "$KIND" delete cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG" >&2 || true
      rm -f "$KUBECONFIG"
      echo "kind-e2e: kind delete cluster: $((SECONDS - t0)) s" >&2
    fi
  fi
}
trap cleanup EXIT
trap 'why="interrupted (SIGINT)"; exit 130' INT
trap 'why="stopped (SIGTERM: the test'"'"'s deadline?)"; exit 143' TERM

[[ -f $FLOW_FILE ]] || fail "FLOW_FILE=$FLOW_FILE does not exist"
if "$KIND" get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  fail "a kind cluster named $CLUSTER exists already (a KEEP_CLUSTER=1 run?); delete it with" \
    "\`$KIND delete cluster --name $CLUSTER\` or choose another name with CLUSTER="
fi

# --- the node image and the cluster ---------------------------------------------------------------
config=$(mktemp)
if [[ $NODE_IMAGE == local ]]; then
  step "node image: assembled here for the pinned Kubernetes version (no registry is used)"
  t0=$SECONDS
  node_ref=$(./dev kind node-image)
  figures+=("node image (built or cached): $((SECONDS - t0)) s")
  [[ $PROVIDER == docker ]] && ./dev kind to-docker "$node_ref"
  note "node image $node_ref"
  ./dev kind config --name "$CLUSTER" --node-image local --image-ref "$node_ref" >"$config"
else
  step "node image: kind's stock image (a registry is reachable)"
  ./dev kind config --name "$CLUSTER" --node-image stock >"$config"
fi

step "kind create cluster"
mkdir -p "$(dirname "$KUBECONFIG")"
created=1
timed "kind create cluster" "$KIND" create cluster --config "$config" --kubeconfig "$KUBECONFIG" --wait 120s
rm -f "$config"
kubectl get nodes -o wide

# --- the images -----------------------------------------------------------------------------------
step "images: build and load"
if [[ $NODE_IMAGE == local ]]; then
  images_out=$(./dev kind images)   # the local stack's build: OPERATOR_IMAGE RUNNER_IMAGE DEVSTACK_IMAGE
  eval "$images_out"
  timed "load images" ./dev kind load --provider "$PROVIDER" "$NODE" "$OPERATOR_IMAGE" "$RUNNER_IMAGE" \
    "$DEVSTACK_IMAGE"
else
  OPERATOR_IMAGE=flowkube-operator:e2e RUNNER_IMAGE=flowkube-runner:e2e DEVSTACK_IMAGE=flowkube-devstack:e2e
  docker build -q -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
  docker build -q -f runner/Dockerfile -t "$RUNNER_IMAGE" .
  devstack_ctx=$(mktemp -d)
  cp devstack/flowkube_devstack/stubmodel.py tests/integration/fakerunner.py "$devstack_ctx/"
  docker build -q -f devstack/Dockerfile --build-arg RUNNER_IMAGE="$RUNNER_IMAGE" -t "$DEVSTACK_IMAGE" "$devstack_ctx"
  rm -rf "$devstack_ctx"
  timed "load images" "$KIND" load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$RUNNER_IMAGE" "$DEVSTACK_IMAGE"
fi

# --- the model ------------------------------------------------------------------------------------
runner_env='{}'
if [[ $STUB_MODEL == 1 ]]; then
  step "the stub model (an OpenAI-compatible stand-in; set OPENAI_API_KEY for a real model)"
  stub_url=$(./dev kind stub-model --kubectl "$KUBECTL" "$DEVSTACK_IMAGE")
  runner_env="{\"OPENAI_BASE_URL\": \"$stub_url/v1\", \"CREWAI_TRACING_ENABLED\": \"false\"}"
  api_key=stub
else
  api_key=${OPENAI_API_KEY:?STUB_MODEL=0 needs OPENAI_API_KEY}
fi

# --- the chart ------------------------------------------------------------------------------------
step "helm install"
timed "helm install --wait" "$HELM" install flowkube charts/flowkube --namespace "$NAMESPACE" --create-namespace \
  --wait --timeout "${TIMEOUT}s" \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set image.pullPolicy=Never \
  --set runner.image.repository="${RUNNER_IMAGE%:*}" --set runner.image.tag="${RUNNER_IMAGE##*:}" \
  --set runner.image.pullPolicy=Never \
  --set-json "runner.defaultEnv=$runner_env"
kubectl -n "$NAMESPACE" get pods
# Runner pods find the model by its Service name: cluster DNS must answer before the first run.
kubectl -n kube-system rollout status deployment/coredns --timeout="${TIMEOUT}s"
# A Ready operator pod is not yet a reachable webhook: the Service's endpoints reach kube-proxy a
# moment after `helm install --wait` returns, and until then the API server's call is refused. Wait
# until a server-side dry run of the Flow passes through the webhook (any other error fails at once).
wait_webhook() {
  local t0=$SECONDS deadline=$((SECONDS + TIMEOUT)) out=""
  while ((SECONDS < deadline)); do
    out=$(kubectl create -f "$FLOW_FILE" --dry-run=server -o name 2>&1) && { note "webhook answers after $((SECONDS - t0)) s"; return 0; }
    [[ $out == *"failed calling webhook"* ]] || { why="server-side dry run of $FLOW_FILE: $out"; echo "kind-e2e: $why" >&2; return 1; }
    sleep 1
  done
  why="the admission webhook did not answer within $TIMEOUT s: $out"
  echo "kind-e2e: $why" >&2
  return 1
}

# --- the flow -------------------------------------------------------------------------------------
step "the flow: $FLOW_FILE"
kubectl create secret generic openai-api --from-literal=OPENAI_API_KEY="$api_key"
wait_webhook
flow=$(kubectl create -f "$FLOW_FILE" -o name)

wait_phase() {  # wait_phase PHASE: until the Flow is in PHASE; fails at once if it Failed
  local want=$1 t0=$SECONDS deadline=$((SECONDS + TIMEOUT)) phase=""
  while ((SECONDS < deadline)); do
    phase=$(kubectl get "$flow" -o jsonpath='{.status.phase}')
    [[ $phase == "$want" ]] && { note "$flow is $want"; return 0; }
    [[ $phase == Failed ]] && break
    sleep 1
  done
  why="$flow is ${phase:-without a phase}, expected $want after $((SECONDS - t0)) s: $(kubectl get "$flow" -o jsonpath='{.status.message}' 2>&1)"
  echo "kind-e2e: $why" >&2
  return 1
}
wait_phase AwaitingFeedback
kubectl get flows
echo "asks: $(kubectl get "$flow" -o jsonpath='{.status.feedback.request.message}')"

step "answer with the raw status patch"
echo "\$ kubectl patch $flow --subresource=status --type=merge -p '{\"status\":{\"feedback\":{\"response\":{\"text\":\"approved\"}}}}'"
kubectl patch "$flow" --subresource=status --type=merge \
  -p '{"status":{"feedback":{"response":{"text":"approved"}}}}'
wait_phase Succeeded
kubectl get flows

step "usage"
kubectl get "$flow" -o jsonpath='{.status.usage}{"\n"}'

step "metrics"
# The per-flow series come from the replica holding the Lease (the other exports none). /metrics
# answers a user allowed `get /metrics`: a ServiceAccount bound to the chart's metrics-reader
# ClusterRole, as you would bind your Prometheus's.
kubectl -n "$NAMESPACE" create serviceaccount metrics-scraper
kubectl create clusterrolebinding flowkube-metrics-scraper --clusterrole=flowkube-metrics-reader \
  --serviceaccount="$NAMESPACE:metrics-scraper"
token=$(kubectl -n "$NAMESPACE" create token metrics-scraper)
leader=$(kubectl -n "$NAMESPACE" get lease flowkube-operator -o jsonpath='{.spec.holderIdentity}')
"$KUBECTL" -n "$NAMESPACE" port-forward "pod/$leader" "$METRICS_PORT:9090" >/dev/null &
port_forward=$!
deadline=$((SECONDS + 30))
until metrics=$(curl -sf -H "Authorization: Bearer $token" "localhost:$METRICS_PORT/metrics"); do
  ((SECONDS < deadline)) || fail "/metrics of $leader did not answer on port $METRICS_PORT"
  sleep 0.5
done
stop_port_forward
series=$(grep -E '^flowkube_(flow_tokens_total|flow_llm_requests_total|flow_runs_total|flow_phase|flows)\b' \
  <<<"$metrics" | grep -v ' 0$' || true)
grep -q "flow=\"${flow##*/}\"" <<<"$series" || fail "/metrics has no series of ${flow##*/}"
echo "$series"

# --- figures --------------------------------------------------------------------------------------
step "figures"
memory=$(./dev kind memory --provider "$PROVIDER" "$NODE")
for f in "${figures[@]}" "$memory" "whole script: $((SECONDS - started)) s"; do note "$f"; done
echo "kind-e2e: passed"
