"""``python -m jaxrl_async.launch.local``: the roles of a run on this host (``distributed.launch``)."""
import sys

from jaxrl_async.distributed.launch import main

if __name__ == "__main__":
    sys.exit(main())
