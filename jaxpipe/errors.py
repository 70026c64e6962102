"""Exceptions raised for bad pipeline inputs (schedule errors live in jaxpipe.schedule)."""


class PipelineError(ValueError):
    """A pipeline input is invalid; the message names the problem and how to fix it."""
