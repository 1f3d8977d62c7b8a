"""gRPC (grpcio, sync API): ``server`` (deadlines and admission), ``client`` (budgets on every call).

``metadata`` holds the metadata keys both sides share.
"""
