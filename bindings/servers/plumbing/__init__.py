"""What the server embeddings and the front door share (docs/development/layout.md has the map).

The dispatcher (the admission queue and fixed workers in place of a server's
own queue), raw connections' admission for the socket-level servers, the head
reader and its compiled twin, refusals as bytes, socket watching, gunicorn's
occupancy table, loading a ``MODULE:APP`` and naming a host's processes.
Nothing here imports a server or the command.
"""
