"""The runner's crewAI boundary: this package is the only part of the runner that imports crewAI
(an import-linter contract in ``pyproject.toml`` holds it to that).

Its pieces plug into crewAI's own extension points (``set_flow_persistence_factory``,
``flow_config.hitl_provider``, the event bus, model-call hooks); the few private attributes used are
confined to ``runtime`` and say why.

- ``api``, ``state``: what the run may name before crewAI is loaded (crewAI-free): the engine's
  exceptions, ``Ending`` (how a flow returned) and the durable state document.
- ``session``: ``FlowSession``, the flow of this process as the run drives it (load, kickoff,
  resume, retry) and what came back (``Ending``), in the runner's own types.
- ``usage``: ``UsageRecorder``, token usage from crewAI's LLM call events, and which model calls may
  start (the token budget; none once the runner is stopping).
- ``persistence``: crewAI persistence and the human-feedback provider, backed by the state object.
- ``runtime``: what crewAI leaves out of persistence, snapshotted and restored.
- ``rebuilds``: pydantic's build of a deferred model on first use, one thread at a time (a flow's
  parallel branches get their first model answers together).
- ``definitions``: inline definitions (crewAI's verdict, for the validate server too) and ``flowRef``
  classes.

This ``__init__`` imports nothing, so that naming ``engine.api`` or ``engine.state`` does not load
crewAI (seconds): a run imports ``session`` and ``usage`` only when it starts.
"""
