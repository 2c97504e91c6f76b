"""`python -m dilocod` is the `dilocod` command."""

from dilocod.cli import main

main()
