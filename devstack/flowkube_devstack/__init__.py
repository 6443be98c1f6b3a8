"""Development tooling: a real local Kubernetes control plane, a local node agent, a stub model.

Nothing shipped (flowkube_api, flowkube_operator, flowkube_runner) imports this package.
"""
