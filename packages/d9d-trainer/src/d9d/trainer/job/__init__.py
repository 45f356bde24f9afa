"""A job before it runs: its YAML read and overridden, its settings checked, its providers resolved."""
