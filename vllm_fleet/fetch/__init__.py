"""Caches on the control machine that fill once per fleet: the wheelhouse and the hub weights."""
