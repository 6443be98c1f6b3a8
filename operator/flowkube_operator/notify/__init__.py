"""Notifications: the pure part (`notices`: which events a Flow's status holds for which sink, the
bodies sent) and the sending (`notifier`)."""
