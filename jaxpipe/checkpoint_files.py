"""The checkpoint directories jaxpipe writes with orbax-checkpoint: one composite
checkpoint a directory, an array tree (``state/``) beside json metadata (``meta/``) that
says which kind it is; writing refuses to replace what is not a checkpoint, reading
names a directory that is not one, or is damaged, in one line.
:mod:`jaxpipe.checkpoint` builds the two public forms on it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxpipe.errors import PipelineError, PipelineTypeError

__all__ = ["FORMAT", "KIND_PARAMS", "KIND_STATE", "abspath", "checkpointer", "damaged",
           "ocp_module", "read_meta", "write"]

FORMAT = 1
KIND_STATE = "jaxpipe.train_state"
KIND_PARAMS = "jaxpipe.params"


def ocp_module():
    """``orbax.checkpoint``, imported at the first checkpoint (it is slow to import)."""
    import orbax.checkpoint as ocp

    return ocp


def checkpointer():
    """The arrays under ``state/``, the json metadata under ``meta/``."""
    ocp = ocp_module()
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler()))


def abspath(path: str | os.PathLike) -> Path:
    """``path`` as the absolute directory orbax needs; a clear error for a non-path."""
    if not isinstance(path, str | os.PathLike):
        raise PipelineTypeError(
            f"a checkpoint path must be a str or os.PathLike (a directory), got "
            f"{type(path).__name__}.")
    return Path(path).expanduser().absolute()


# Files orbax writes into every checkpoint directory it finishes.
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")


def looks_like_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint (what ``overwrite=True`` may replace)."""
    return path.is_dir() and (any((path / m).exists() for m in ORBAX_MARKERS)
                              or (path / "meta").is_dir() or (path / "state").is_dir())


def reason(err: BaseException) -> str:
    """The first readable sentence of a (tensorstore/orbax) error, without driver specs."""
    text = " ".join(str(err).split())
    for cut in (" [tensorstore_spec", "[tensorstore_spec", " [source locations", "; spec="):
        text = text.split(cut)[0]
    return text if len(text) <= 200 else text[:200] + " ..."


def damaged(path: Path, what: str, err: BaseException) -> PipelineError:
    """The error for a checkpoint whose ``what`` cannot be read (``err`` says why)."""
    return PipelineError(
        f"the checkpoint at {str(path)!r} is damaged: {what} ({type(err).__name__}: "
        f"{reason(err)}). Restore from another copy, or save it again.")


def write(path: Path, tree: Any, meta: dict, overwrite: bool) -> None:
    """Save ``tree`` and ``meta`` at ``path``; replace only a checkpoint, and only with
    ``overwrite``."""
    ocp = ocp_module()
    if not isinstance(overwrite, bool):
        raise PipelineTypeError(f"overwrite must be True or False, got {overwrite!r}.")
    if path.exists() and not overwrite:
        raise PipelineError(
            f"checkpoint directory {str(path)!r} already exists; pass overwrite=True to "
            "replace it or choose a new path (e.g. one directory per step)."
        )
    if path.exists() and not (looks_like_checkpoint(path)
                              or (path.is_dir() and not any(path.iterdir()))):
        kind = "a directory that is not a checkpoint" if path.is_dir() else "a file"
        raise PipelineError(
            f"{str(path)!r} is {kind}; overwrite=True only replaces checkpoints, so its "
            "contents stay. Choose another path, or remove it yourself first."
        )
    checkpointer().save(
        path,
        args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                meta=ocp.args.JsonSave(meta)),
        force=overwrite,
    )


def read_meta(path: Path, want_kind: str) -> tuple[dict, Any]:
    """The checkpoint's json metadata and its array-tree metadata; clear errors if not ours."""
    if not path.is_dir():
        raise PipelineError(f"no checkpoint at {str(path)!r} (not a directory).")
    if not looks_like_checkpoint(path):
        raise PipelineError(
            f"{str(path)!r} is not a jaxpipe checkpoint (no checkpoint files in it; "
            "jaxpipe.checkpoint.save and save_params write them)."
        )
    ocp = ocp_module()
    ckptr = checkpointer()
    try:
        meta = ckptr.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:  # orbax/tensorstore raise many types for a bad directory
        raise damaged(path, "its metadata (meta/) cannot be read", err) from err
    if not isinstance(meta, dict) or meta.get("kind") not in (KIND_STATE, KIND_PARAMS):
        raise PipelineError(
            f"{str(path)!r} is an orbax checkpoint but not a jaxpipe one (its metadata has "
            f"no jaxpipe kind); read it with orbax, or save with jaxpipe.checkpoint."
        )
    try:
        tree_meta = ckptr.metadata(path).item_metadata["state"].tree
    except Exception as err:
        raise damaged(path, "the array metadata (state/) cannot be read", err) from err
    kind = (meta or {}).get("kind")
    if kind != want_kind:
        other = {KIND_STATE: "restore", KIND_PARAMS: "restore_params"}.get(kind, "?")
        raise PipelineError(
            f"{str(path)!r} holds a {kind!r} checkpoint, not {want_kind!r}; read it with "
            f"jaxpipe.checkpoint.{other}."
        )
    return meta, tree_meta
