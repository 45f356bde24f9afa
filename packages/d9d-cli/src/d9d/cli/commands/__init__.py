"""One module per `d9d` command; each defines one click command, registered in `d9d.cli.main`."""
