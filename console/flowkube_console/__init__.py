"""The flowkube web console: the people in the loop answer feedback requests, talk to conversations
and follow runs in a browser, with their own Kubernetes credentials (docs/console.md)."""
