"""Clients of a running service: smoke tests, the load generator, bench and tune engines, reports."""
