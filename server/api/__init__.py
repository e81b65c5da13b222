"""The HTTP service: the OpenAI protocol models, routes, auth, limits, draining,
disconnects, the access log, metrics, errors, request records and shutdown. It drives the
engine (server/engine/) and never touches MLX itself."""
