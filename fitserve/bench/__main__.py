"""`python -m fitserve.bench serve|throughput|latency ...` runs `fitserve bench ...`."""

import sys

from fitserve.bench.cli_bench import main

if __name__ == "__main__":
    sys.exit(main())
