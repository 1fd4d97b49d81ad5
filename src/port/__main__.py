"""`python -m port` runs the command line."""

from ._cli import main

main()
