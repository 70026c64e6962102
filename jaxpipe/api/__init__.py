"""The user's entry point: ``jp.pipeline`` and the :class:`Pipeline` it returns.

Owns building a pipeline (:mod:`~jaxpipe.api.pipeline`: trace, cut, split, hand the
stages to a runtime), cutting and splitting for one schedule
(:mod:`~jaxpipe.api.cut_and_split`), ``schedule="auto"`` (:mod:`~jaxpipe.api.auto`), the
checks and placement of a call's inputs (:mod:`~jaxpipe.api.inputs`,
:mod:`~jaxpipe.api.input_placement`), the plan it prints (:mod:`~jaxpipe.api.plan`) and
what ``pipe.inspect`` reports (:mod:`~jaxpipe.api.reports`).
May import every layer below it (jaxpr, sharding, schedule, stages, cut, train, runtime);
integrations (flax, checkpoint, aot) and tools build on it.
"""
