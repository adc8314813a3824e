"""What every program of the drop-in suite does at its end: each difference from PyTorch's
behaviour on stderr and exit status 1, or "ok" and exit status 0 (run.sh reads both)."""
import sys


def report(errors):
    if errors:
        for e in errors:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print("ok")
