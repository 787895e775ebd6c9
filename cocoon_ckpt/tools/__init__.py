"""Read-only views of a committed store: audit, catalog (inspect, diff, gc), export,
plots. Nothing here imports the trainer or the job runner."""
