"""Runs pytest on the test files given as arguments (the main of every Python py_test)."""

import os
import sys


def main():
    import pytest

    # Keep pytest's cache out of the (read-only) runfiles tree.
    args = ["-q", "-p", "no:cacheprovider", "-rs"] + sys.argv[1:]
    return pytest.main(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
