"""funduq-trio: a broker between AI agent providers and their callers, on trio."""
