"""The modules named after a library prazo plugs into: each imports its library, which the service installs.

They may import the primitives (``prazo.bindings.wsgi``, ``.pool``,
``.outgoing``, ``.headers``, ...) and the shared plumbing
(``prazo.bindings.plumbing``); neither ever imports them
(``tests/test_layout.py``).
"""
