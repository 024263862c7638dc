#!/usr/bin/env python3
"""cluster-generic cancel command for profiles/local-cluster: stop jobs by id.

Usage (by Snakemake): cancel.py JOBID... Each id is the pid of a job's session
(see submit.py); the whole session gets SIGTERM.
"""
import os
import signal
import sys


def main() -> int:
    for jobid in sys.argv[1:]:
        try:
            os.killpg(int(jobid), signal.SIGTERM)
        except (ValueError, ProcessLookupError, PermissionError):
            pass  # finished already, or not ours
    return 0


if __name__ == "__main__":
    sys.exit(main())
