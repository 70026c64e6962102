"""The ``jaxpipe`` command and what only it runs.

Owns the command line (:mod:`~jaxpipe.tools.cli`: ``jaxpipe plan``, ``compile``,
``calibrate``, ...) and the calibration run (:mod:`~jaxpipe.tools.calibrate`). The top
layer: may import any other; nothing in the package imports it.
"""
