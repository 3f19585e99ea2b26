"""`python -m jaxrl_async.serve`: the entry point of ``cli/serve.py`` (see its documentation)."""
import sys

from jaxrl_async.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
