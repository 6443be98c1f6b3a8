"""Development tooling: a real local Kubernetes cluster (control plane and node), image builds, a stub model.

Nothing shipped (flowkube_api, flowkube_operator, flowkube_runner, flowkube_kubectl) imports this package.
"""
