"""Caches on the control machine that fill once per fleet: the wheelhouse and the hub weights,
and the sha256 of a model tree (treehash: once per content, across deploys)."""
