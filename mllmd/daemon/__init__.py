"""The daemon's main process: configuration, supervisor, HTTP server, request manager."""
