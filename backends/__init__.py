"""Backends of fusedops, installed as ``fusedops.backends``.

Each backend package holds one module per operator family. A module knows how to compute, never
validates user input (the plan in ``fusedops/`` has done that), and exposes a small surface:
``unsupported_reason(problem)`` and launcher builders called from ``Plan.compile()``.
"""
