# SPDX-License-Identifier: Apache-2.0
"""The bottom layer: array backend, argument validators, the kernel loader, typed launches, timing.

Nothing here imports another layer of the package (``formats``, ``routing``, ``experts``,
``layer``, ``io``); every layer above may import it.
"""
