"""prazo.bindings — what a service imports: prazo.core plugged into WSGI, executors, servers and clients.

One module (or subpackage) per thing it plugs into — ``wsgi``, ``pool``,
``sqlite``, ``servers.<server>``, ``clients.<client>`` — and the pieces they
share (``headers``, ``proxy_headers``, ``outgoing``, ``reaper``). Bindings
import ``prazo.core`` only; neither the core nor any binding imports
``prazo.bench``.
"""
