"""`python -m primerl COMMAND ...`: the same as the installed `primerl` command (primerl.cli)."""

from primerl.cli import main

main()
