"""The `accelerate-c` command line: one module per subcommand."""
