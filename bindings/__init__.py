"""prazo.bindings — adapters from prazo.core to WSGI, executors, servers and clients.

Bindings may import ``prazo.core``; the core never imports bindings.
"""
