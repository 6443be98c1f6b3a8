"""Flows: the cache the watches feed (`cache`), the controller (`controller`), the pure reconcile
(`reconcile`) and what it builds on (`resources`: the runner pod; `conditions`; `refusals`: the inbox
rules), the run reports (`reports`), and the per-flow metrics (`metrics`)."""
