"""``python -m trioserve``: the ``trioserve`` command."""

from trioserve.cli import entry

if __name__ == "__main__":
    entry()
