"""The operator's servers for others: the state API runner pods use (`stateapi`) and the admission
webhooks (`webhook`)."""
