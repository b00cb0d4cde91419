"""`python -m variants.cli …` works like the `blaze` command."""

from variants.cli import main

main()
