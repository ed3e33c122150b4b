"""The wire: the protocol, the request/reply client, the workers' control channel and CURVE keys."""
