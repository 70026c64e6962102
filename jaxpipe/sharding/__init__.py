"""The sharding layer: how a pipeline uses its mesh, its devices and the model's own sharding.

Owns the mesh axes' roles (:mod:`~jaxpipe.sharding.mesh_axes`: the pipe axis, batch axes,
parameter sharding), the stages' parameter inputs as views of the user's leaves
(:mod:`~jaxpipe.sharding.param_views`), the model's sharding constraints and gathers
inside the manual program (:mod:`~jaxpipe.sharding.constraints`,
:mod:`~jaxpipe.sharding.gathers`) and what memory a device offers
(:mod:`~jaxpipe.sharding.device_memory`). Imports the jaxpr layer and the foundation.
"""
