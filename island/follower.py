"""Entry point of the follower ranks that `dipaco island join --nproc N` starts: `python -m island.follower`.

A separate module (not `python -m island.distributed`) so that running it does not re-execute a module the
`island` package has already imported.
"""

from __future__ import annotations

import argparse

from island.distributed import exit_rank, follower_main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A follower rank of a multi-process island (internal).")
    parser.add_argument("--device", default="auto")
    exit_rank(follower_main(parser.parse_args().device))
