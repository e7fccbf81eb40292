"""The wire: the one protocol module, the client, CurveZMQ, the engine's view of a daemon arena."""
