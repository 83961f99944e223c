"""One module per ``thinkpool`` command (the parser lives in :mod:`orchestrator.cli`)."""
