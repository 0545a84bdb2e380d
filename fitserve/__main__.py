"""`python -m fitserve ...` runs the `fitserve` command."""

import sys

from fitserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
