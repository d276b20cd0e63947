"""`python -m fleet` is the `fleet` command (for hosts where the script is not on PATH)."""

from .cli import main

main()
