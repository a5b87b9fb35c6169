# SPDX-License-Identifier: Apache-2.0
"""The package version (one place: the package, the CLI and ``pyproject.toml`` agree)."""

__version__ = "0.1.0"
