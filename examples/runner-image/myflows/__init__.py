"""Example flow package for a custom flowkube runner image."""
