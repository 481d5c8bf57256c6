"""Hardware traces: the `tagplan-traces/1` bundle format and importers of what machines already print."""
