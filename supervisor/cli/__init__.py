"""The ``resurgo`` command line: one module per subcommand, each with ``register``."""
