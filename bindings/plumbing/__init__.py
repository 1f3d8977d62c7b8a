"""What several bindings share and no service needs to import: the deadline reaper, the metric table, the framework glue.

Plumbing may import the primitives of ``prazo.bindings``, never an
integration (``tests/test_layout.py``).
"""
