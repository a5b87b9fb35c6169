# SPDX-License-Identifier: Apache-2.0
"""``python -m cupymoe``: the ``cupymoe`` command (:func:`cupymoe.cli.main`) without its script,
e.g. from a source tree on ``PYTHONPATH`` where the package is not installed."""

from cupymoe.cli import main

if __name__ == "__main__":
    main()
