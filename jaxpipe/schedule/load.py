"""Resolve a schedule name or ``path/to/file.py:ClassName`` to a ``Schedule`` subclass.

Used by the CLI and by ``jp.load_schedule``. Built-in names are case-insensitive;
anything with a ``:`` is ``<file.py or dotted.module>:<ClassName>``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from .action import ScheduleError
from .base import Schedule
from .gpipe import GPipe
from .interleaved import Interleaved1F1B
from .one_f_one_b import OneFOneB

#: Canonical built-in names -> classes.
BUILTIN_SCHEDULES: dict[str, type[Schedule]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": Interleaved1F1B,
}

# Extra spellings accepted by load_schedule (compared after lower-casing).
_ALIASES: dict[str, str] = {
    "interleaved1f1b": "interleaved",
    "interleaved-1f1b": "interleaved",
    "interleaved_1f1b": "interleaved",
    "onefoneb": "1f1b",
}


def _valid_names() -> str:
    return (
        ", ".join(BUILTIN_SCHEDULES)
        + " (or 'path/to/file.py:ClassName', 'package.module:ClassName')"
    )


def _import_file(path: Path):
    """Import a Python file by path under a unique, stable module name."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"jaxpipe_user_schedule_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ScheduleError(f"cannot import schedule file {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses/pickle look the module up here
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ScheduleError(
            f"cannot import schedule file {str(path)!r}: {_where(err, path)}"
        ) from err
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _where(err: BaseException, path: Path) -> str:
    """``'SyntaxError at line 3: expected ':''`` — the error and where in ``path`` it is."""
    line = getattr(err, "lineno", None) if isinstance(err, SyntaxError) else None
    if line is None:
        tb = err.__traceback__
        while tb is not None:
            if Path(tb.tb_frame.f_code.co_filename).resolve() == path.resolve():
                line = tb.tb_lineno
            tb = tb.tb_next
    msg = getattr(err, "msg", None) if isinstance(err, SyntaxError) else str(err)
    return f"{type(err).__name__}{f' at line {line}' if line else ''}: {msg}"


def load_schedule(name_or_path: str | type[Schedule]) -> type[Schedule]:
    """Return the ``Schedule`` subclass named by ``name_or_path``.

    - ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (also ``"interleaved1f1b"``), any
      case: the built-ins in :data:`BUILTIN_SCHEDULES`.
    - ``"schedules/zero_bubble.py:ZeroBubbleH1"``: import that file (relative to the
      current directory) and take the class.
    - ``"mypkg.schedules:MySchedule"``: import the module and take the class.
    - A ``Schedule`` subclass is returned unchanged.

    Raises :class:`ScheduleError` naming the problem (unknown name, missing file,
    missing class, not a Schedule subclass) and listing the valid names.
    """
    if isinstance(name_or_path, type):
        if issubclass(name_or_path, Schedule):
            return name_or_path
        raise ScheduleError(f"{name_or_path!r} is not a Schedule subclass")
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ScheduleError(f"schedule name must be a non-empty str; valid: {_valid_names()}")
    text = name_or_path.strip()
    key = text.lower()
    key = _ALIASES.get(key, key)
    if key in BUILTIN_SCHEDULES:
        return BUILTIN_SCHEDULES[key]
    if ":" not in text:
        hint = " (add ':ClassName' after the file)" if text.endswith(".py") else ""
        raise ScheduleError(f"unknown schedule {text!r}{hint}; valid: {_valid_names()}")

    source, class_name = text.rsplit(":", 1)
    if not class_name.isidentifier():
        raise ScheduleError(f"{class_name!r} in {text!r} is not a class name")
    path = Path(source)
    if path.is_dir():
        raise ScheduleError(
            f"schedule file {source!r} is a directory; name the Python file that defines "
            f"the class, e.g. '{source.rstrip('/')}/my_schedule.py:{class_name}'"
        )
    if source.endswith(".py") or path.exists():
        if not path.is_file():
            raise ScheduleError(
                f"schedule file {source!r} not found (looked in {Path.cwd()}); "
                f"valid: {_valid_names()}"
            )
        module = _import_file(path)
    else:
        if not all(part.isidentifier() for part in source.split(".")):
            raise ScheduleError(
                f"{source!r} is neither a Python file (path/to/file.py) nor a module name "
                f"(package.module); valid: {_valid_names()}"
            )
        try:
            module = importlib.import_module(source)
        except ImportError as err:
            raise ScheduleError(
                f"cannot import schedule module {source!r}: {err}; valid: {_valid_names()}"
            ) from err
        except Exception as err:  # the module itself fails while importing
            raise ScheduleError(
                f"cannot import schedule module {source!r}: {type(err).__name__}: {err}"
            ) from err

    cls = getattr(module, class_name, None)
    if cls is None:
        found = sorted(
            n for n, v in vars(module).items()
            if isinstance(v, type) and issubclass(v, Schedule) and v is not Schedule
            and not n.startswith("_") and not inspect.isabstract(v)  # (helpers, bases)
        )
        raise ScheduleError(
            f"{source!r} has no class {class_name!r}; Schedule subclasses there: "
            f"{', '.join(found) or 'none'}"
        )
    if not (isinstance(cls, type) and issubclass(cls, Schedule)):
        raise ScheduleError(
            f"{source}:{class_name} is not a Schedule subclass (got {cls!r}); "
            "subclass jaxpipe.Schedule and implement device_actions"
        )
    return cls
