"""`kubectl flow`, the flowkube kubectl plugin (installed as the console script `kubectl-flow`).

It imports only the standard library and flowkube_api.constants (itself standard library only): never
the models (pydantic), the operator or the runner, so that it stays light (the import-linter contracts
in pyproject.toml hold it to that). It talks to the cluster through `kubectl` itself.
"""
