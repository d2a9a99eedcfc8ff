"""`python -m poolserve`: the `poolserve` command."""

from poolserve.cli import main

main()
