"""User code named in the config: `package.module:attr` (importable) or `path/to/file.py:attr` (a file).

Rewards (`reward.fn`) and generate functions (`rollout.generate_fn`) are found this way; each passes its
kind, so an error says which setting to fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from miles.errors import MilesUserError


def normalize(spec: str, kind: str, error: type[Exception] = MilesUserError) -> str:
    """`spec` with a file path made absolute (worker processes may run elsewhere); checks its form."""
    spec = str(spec).strip()
    if ":" not in spec:
        raise error(
            f"{kind} {spec!r}: use a dotted path 'package.module:function' or a file path 'path/to/file.py:function'"
        )
    location, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise error(f"{kind} spec {spec!r}: {attr!r} after ':' is not a Python name")
    if _is_file(location):
        return f"{Path(location).expanduser().resolve()}:{attr}"
    return spec


def load(target: str, kind: str, error: type[Exception] = MilesUserError) -> Any:
    """The object a normalized spec names."""
    location, attr = target.rsplit(":", 1)
    if _is_file(location):
        module = _load_file_module(location, kind, error)
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as e:
            raise error(
                f"cannot import {kind} module {location!r} ({e}); is it installed / on "
                "PYTHONPATH? A file can be given as path/to/file.py:function"
            ) from e
        except Exception as e:
            raise error(f"importing {kind} module {location!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise error(f"{location} has no {attr!r}; callables there: {public[:20]}")
    return getattr(module, attr)


def _is_file(location: str) -> bool:
    return location.endswith(".py") or "/" in location


def _load_file_module(path: str, kind: str, error: type[Exception]) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise error(f"{kind} file {path} does not exist (spec form: path/to/file.py:function)")
    # One module per file whatever the kind, so a file holding a reward and a generate function loads once.
    name = "miles_plugin_file_" + hashlib.sha1(str(file).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise error(f"cannot import {file} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise error(f"importing {kind} file {file} failed: {type(e).__name__}: {e}") from e
    return module
