"""What a controller runs on, as client-go and controller-runtime give it in Go: the API client
(`client`, on `http1`), list-then-watch (`informer`), the Lease (`leader`), the serving certificates
(`tls`), token checks (`issuerkeys`, `reviews`), and the controller shell every kind runs in
(`shell`, on `workqueue`). It knows the paths of the operator's kinds, nothing of what they do."""
