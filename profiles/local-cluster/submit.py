#!/usr/bin/env python3
"""cluster-generic submit command for profiles/local-cluster: run a jobscript detached.

Usage (by Snakemake): submit.py JOBSCRIPT. Starts `bash JOBSCRIPT` in its own session,
output to .snakemake/local-cluster/<jobid>.log, and prints the job id (the session's
pid, which cancel.py signals). Job success or failure reaches Snakemake through the
marker files that the jobscript writes in the shared working directory.
"""
import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    jobscript = sys.argv[-1]
    logs = Path(".snakemake/local-cluster")
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / f"{Path(jobscript).stem}.{os.getpid()}.log", "wb")
    proc = subprocess.Popen(["bash", jobscript], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    print(proc.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
