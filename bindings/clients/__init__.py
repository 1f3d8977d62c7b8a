"""prazo.bindings.clients — outgoing calls that carry the remaining budget.

One module per HTTP client it wraps: ``requests`` (``DeadlineSession``),
``httpx`` (``DeadlineTransport``), ``urllib3`` (``DeadlinePoolManager``) and
``urllib`` (``deadline_urlopen``). Each imports its client and
``prazo.bindings.outgoing``, where the budget is computed; nothing is
re-exported here, so using one adapter never imports the other clients.
"""
