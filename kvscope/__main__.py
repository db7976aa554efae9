"""`python -m kvscope ...` is the `kvscope` command."""

import sys

from kvscope.cli import main

if __name__ == "__main__":  # not when a spawned tensor-parallel rank re-imports the parent's main module
    sys.exit(main())
