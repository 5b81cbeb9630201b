"""The health monitor: the single writer of node leases (``llmgw health``).

``leases`` is its pure core (the ``LeaseBook``: heartbeats and time in,
transitions and due writes out); ``service`` is the shell on the bus that feeds
it, stores leases and publishes transitions as events.
"""
