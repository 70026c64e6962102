"""Exceptions raised for bad pipeline inputs (schedule errors live in jaxpipe.schedule)."""


class PipelineError(ValueError):
    """A pipeline input is invalid; the message names the problem and how to fix it."""


class PipelineTypeError(PipelineError, TypeError):
    """An argument of the wrong type (a class where an instance is expected, a train
    state where parameters are expected, ...); also a ``TypeError``."""
