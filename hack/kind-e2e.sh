#!/usr/bin/env bash
# End to end on kind (needs docker, kind, kubectl, helm, curl): build both images, install the chart,
# run a flow that asks for feedback, answer it with the raw status patch, show usage and metrics.
#
#   OPENAI_API_KEY=sk-... hack/kind-e2e.sh     # the key goes into Secret llm-api-keys
#   KEEP_CLUSTER=1 hack/kind-e2e.sh            # leave the cluster for poking around
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CLUSTER=${CLUSTER:-flowkube-e2e}
NAMESPACE=${NAMESPACE:-flowkube-system}
FLOW_FILE=${FLOW_FILE:-examples/flows/inline-feedback.yaml}
TAG=${TAG:-e2e}
HELM=${HELM:-helm}
TIMEOUT=${TIMEOUT:-5m}
METRICS_PORT=${METRICS_PORT:-19090}

port_forward=""
cleanup() {
  local rc=$?
  [[ -n $port_forward ]] && kill "$port_forward" 2>/dev/null
  if [[ $rc -ne 0 ]]; then
    echo "--- failed (exit $rc)" >&2
    kubectl get flows -A -o wide >&2 || true
    kubectl -n "$NAMESPACE" logs deployment/flowkube --all-containers --tail=100 >&2 || true
  fi
  [[ ${KEEP_CLUSTER:-0} == 1 ]] || kind delete cluster --name "$CLUSTER" || true
}
trap cleanup EXIT

for tool in docker kind kubectl "$HELM" curl; do
  command -v "$tool" >/dev/null || { echo "kind-e2e: $tool is not on PATH" >&2; exit 1; }
done

kind create cluster --name "$CLUSTER" --wait 120s
docker build -f operator/Dockerfile -t "flowkube-operator:$TAG" .
docker build -f runner/Dockerfile -t "flowkube-runner:$TAG" .
kind load docker-image --name "$CLUSTER" "flowkube-operator:$TAG" "flowkube-runner:$TAG"

"$HELM" install flowkube charts/flowkube --namespace "$NAMESPACE" --create-namespace \
  --wait --timeout "$TIMEOUT" \
  --set image.repository=flowkube-operator --set image.tag="$TAG" --set image.pullPolicy=Never \
  --set runner.image.repository=flowkube-runner --set runner.image.tag="$TAG" \
  --set runner.image.pullPolicy=Never

if [[ -n ${OPENAI_API_KEY:-} ]]; then
  kubectl create secret generic llm-api-keys --from-literal=OPENAI_API_KEY="$OPENAI_API_KEY"
fi

flow=$(kubectl create -f "$FLOW_FILE" -o name)
kubectl wait "$flow" --for=jsonpath='{.status.phase}'=AwaitingFeedback --timeout="$TIMEOUT"
kubectl get "$flow" -o jsonpath='{.status.feedback.request.message}{"\n"}'
kubectl patch "$flow" --subresource=status --type=merge \
  -p '{"status":{"feedback":{"response":{"text":"approved"}}}}'
kubectl wait "$flow" --for=jsonpath='{.status.phase}'=Succeeded --timeout="$TIMEOUT"

echo "--- usage"
kubectl get "$flow" -o jsonpath='{.status.usage}{"\n"}'
kubectl get flows

echo "--- metrics"
# The per-flow series come from the replica holding the Lease (the other exports none).
leader=$(kubectl -n "$NAMESPACE" get lease flowkube-operator -o jsonpath='{.spec.holderIdentity}')
kubectl -n "$NAMESPACE" port-forward "pod/$leader" "$METRICS_PORT:9090" >/dev/null &
port_forward=$!
for _ in $(seq 30); do
  curl -sf "localhost:$METRICS_PORT/metrics" >/dev/null && break
  sleep 1
done
curl -sf "localhost:$METRICS_PORT/metrics" \
  | grep -E '^flowkube_(flow_tokens_total|flow_llm_requests_total|flow_runs_total|flow_phase|flows)\b'
echo "kind-e2e: passed"
