"""One module per `d9d` command; each defines one click command named like its module, listed in `d9d.cli._table.COMMANDS`."""
