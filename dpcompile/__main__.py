"""``python -m dpcompile``: the ``dpcompile`` command (:mod:`dpcompile.cli`)."""

from dpcompile.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
