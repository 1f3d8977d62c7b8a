"""prazo.bindings.servers — admission at a threaded server's own queue.

One module per server it plugs into (``waitress``, ``gunicorn``, ``cheroot``,
``werkzeug``, ``wsgiref``), prazo's own server (``frontdoor/``) and ``serve``
(the ``prazo serve`` command), built on ``settings`` (each setting declared
once: its field, flag, variable and check) and ``plumbing/`` (what they all
share: the dispatcher, the head reader, refusals, sockets, loading an app).
Imports go down that list: settings, plumbing, the front door, the embeddings,
the command (docs/development/layout.md, the map; the layout test holds it).

Nothing is re-exported here: import from the module that says what it is,
so importing one embedding never imports the other servers.
"""
