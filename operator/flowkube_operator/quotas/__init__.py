"""Spend quotas (issue 41): the pure book of each limit's spend and reservations (`book`)."""
