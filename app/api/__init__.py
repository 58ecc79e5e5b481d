"""HTTP API: routers, schemas, errors, streaming, middleware and the app factory."""
