"""`python -m jaxrl_async.plan`: the entry point of ``cli/plan.py``."""
import sys

from jaxrl_async.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
