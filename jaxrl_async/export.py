"""`python -m jaxrl_async.export`: the entry point of ``cli/export.py`` (see its documentation)."""
import sys

from jaxrl_async.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
