"""The user's own code, imported by the name a config gives it: ``module.path:Name`` (from the working directory,
the repo root or PYTHONPATH) or ``path/to/file.py:Name`` (relative to the working directory, else to the repo
root). Reward functions (``reward.functions``) and turn environments (``env.turn_env``) come this way, and are
called through ``call_user``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from grpo.process.errors import ConfigError, UserCodeError
from grpo.process.setup import REPO_ROOT, raise_if_interrupted_twice


def _import_file(where: str, key: str):
    path = Path(where).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    found = next((p.resolve() for p in candidates if p.is_file()), None)
    if found is None:
        raise ConfigError(f"{key}: no file {where} (looked in {', '.join(str(p.parent) for p in candidates)}); give "
                          "the path of a .py file, absolute or relative to the working directory.")
    # one module per file, registered so that dataclasses and pickling in it work
    name = f"_reward_file_{found.stem}_{hashlib.sha1(str(found).encode()).hexdigest()[:8]}"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, found)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except (ImportError, SyntaxError) as err:
            del sys.modules[name]
            raise ConfigError(f"{key}: importing {found} failed ({type(err).__name__}: {err}); fix it or install "
                              "what it imports.") from err
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _import_module(where: str, key: str):
    if not all(part.isidentifier() for part in where.split(".")):
        raise ConfigError(f"{key}: {where!r} is no module path (dotted names) nor a .py file path.")
    for root in (os.getcwd(), str(REPO_ROOT)):  # `python grpo/grpo.py` puts neither on sys.path
        if root not in sys.path:
            sys.path.append(root)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        if err.name and (where == err.name or where.startswith(err.name + ".")):
            raise ConfigError(f"{key}: no module {err.name!r} in the working directory ({os.getcwd()}), the repo root "
                              "or PYTHONPATH; run from the folder that holds it, add that folder to PYTHONPATH, or "
                              "give path/to/file.py:function.") from err
        raise ConfigError(f"{key}: importing {where} failed ({err}); install what it imports.") from err
    except (ImportError, SyntaxError) as err:
        raise ConfigError(f"{key}: importing {where} failed ({type(err).__name__}: {err}); fix it.") from err


def import_object(spec: str, key: str):
    """What ``module.path:Name`` or ``path/to/file.py:Name`` names (a user's class, say), imported; every problem
    is a ConfigError naming ``key``."""
    where, colon, name = str(spec).rpartition(":")
    if not colon or not where or not name.isidentifier():
        raise ConfigError(f"{key}={spec!r}: write module.path:Name or path/to/file.py:Name.")
    module = _import_file(where, key) if where.endswith(".py") or "/" in where else _import_module(where, key)
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"{key}: {where} defines no {name!r} (it defines: {', '.join(defined) or 'nothing'}); "
                          "fix the name after the colon.")
    return getattr(module, name)


def call_user(what: str, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, the user's code, which ``what`` names. Whatever leaves it is a UserCodeError: one
    line saying what it did, with its own frames only. BaseException too: a ``sys.exit(3)`` in a reward function
    ended the run with status 3, no word and no checkpoint; as an Exception it gets the run's emergency checkpoint."""
    try:
        return fn(*args, **kwargs)
    except BaseException as err:
        raise_if_interrupted_twice()  # the user's second Ctrl-C landed in their code: the run stops now, as asked
        frames = traceback.extract_tb(err.__traceback__)[1:]  # this function's own frame left out
        where = " (its frames are above)" if frames else ""
        raise UserCodeError(f"{what} {_did(err)}; fix it there{where}.", "".join(traceback.format_list(frames))
                            ) from err


def _did(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r}), which would end the run: user code must return, never exit"
    return f"raised {type(err).__name__}" + (f": {err}" if str(err) else "")
