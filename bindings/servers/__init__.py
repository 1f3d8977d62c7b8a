"""prazo.bindings.servers — admission at a threaded server's own queue.

One module per server it plugs into (``waitress``, ``gunicorn``, ``cheroot``,
``werkzeug``, ``wsgiref``) and ``serve`` (the ``prazo serve`` command), built
from the pieces they share: ``settings`` (limits from arguments or the
environment), ``dispatcher`` (the admission queue and fixed workers in place
of the server's queue), ``heads`` (reading a request head without consuming
it), ``sockets`` (one thread watching many sockets), ``refusals`` (503/504/408
as bytes, and a close the client can read them through) and ``connection``
(admission of raw connections, for the socket-level servers).

Nothing is re-exported here: import from the module that says what it is,
so importing one embedding never imports the other servers.
"""
