"""`python -m d9d.cli ...`: the module form of the `d9d` command (for torchrun)."""

from d9d.cli.main import main

if __name__ == "__main__":
    main()
