"""The flowkube operator (kopf)."""
