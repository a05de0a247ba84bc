"""Request sources that arrive while a job runs: interactive stdin and the HTTP server."""
