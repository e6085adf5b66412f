"""What the CLI and the report show, built from the store: documents, report, timeline."""
