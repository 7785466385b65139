"""Registers the loglinear model types with transformers' Auto classes in any process that imported loglinear.

``import loglinear.models`` registers its model types ("loglinear_mamba2", ...) with AutoConfig, AutoModel
and AutoModelForCausalLM, but it imports transformers' modeling code (seconds), so ``import loglinear`` only calls
`install()`, which imports nothing of transformers:

* if transformers' Auto configs (``transformers.models.auto.configuration_auto``) are loaded already, it imports
  loglinear.models at once;
* otherwise it puts a finder first on ``sys.meta_path`` that watches only the modules ``transformers`` and
  ``transformers.*``: it wraps their loaders to track, per thread, the transformers modules being executed, and
  once configuration_auto has loaded and the outermost of those imports has finished, it imports loglinear.models
  and removes itself.

So ``AutoConfig`` / ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(run_dir)`` and
``pipeline("text-generation", model=run_dir)`` load a loglinear model whichever of loglinear and transformers was
imported first, and a process that never loads transformers' Auto classes never imports transformers for loglinear.
The config classes live in loglinear.models, so once the Auto classes load, loglinear.models (with transformers'
modeling code) is imported too.

Why at the end of the outermost transformers import and not right after configuration_auto / modeling_auto:
transformers loads them from the middle of its own modules (``transformers.modeling_layers`` imports AutoModel at its
top), and loglinear.models needs those modules complete; when the outermost import is done, no transformers module is
half executed in this thread. If loglinear.models is itself being imported then, it registers its classes when it
finishes, and the finder goes. A failure to register is a RuntimeWarning, never an error in the transformers import
that set it off; when another thread was importing transformers modules at the time (the two imports may have
clashed), the next outermost transformers import to finish tries again instead. A finder placed before this one that
loads transformers modules itself hides them from the tracking.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings

__all__ = ["install"]

_TRIGGER = "transformers.models.auto.configuration_auto"  # AutoConfig; modeling_auto imports it first
_MODELS = "loglinear.models"  # registers its classes with the Auto classes when imported

_lock = threading.Lock()
_local = threading.local()  # .running: the transformers modules this thread is executing (through the finder)
_done = False


def _watched(name: str) -> bool:
    return name == "transformers" or name.startswith("transformers.")


def _initializing(name: str) -> bool:
    """Whether module `name` is being executed (by any thread)."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _running() -> list[str]:
    if not hasattr(_local, "running"):
        _local.running = []
    return _local.running


def _importing_elsewhere(finished: str | None) -> bool:
    """Whether another thread is executing a transformers module (`finished`: the one this thread just ran)."""
    mine = {*_running(), finished}
    return any(_watched(name) and name not in mine and _initializing(name) for name in list(sys.modules))


def _register(finished: str | None = None) -> None:
    """Import loglinear.models once, unless another thread (or this one, re-entering) is doing it already. A
    failure while another thread imports transformers may be a clash of the two imports: then the next outermost
    transformers import to finish tries again."""
    global _done
    if _done or not _lock.acquire(blocking=False):
        return
    try:
        if not _initializing(_MODELS):  # else it registers its classes when it finishes
            try:
                importlib.import_module(_MODELS)
            except Exception as exc:  # a transformers import must not fail because of loglinear
                if _importing_elsewhere(finished):
                    return
                warnings.warn(f"loglinear could not register its model types with transformers' Auto classes: "
                              f"{exc!r}", RuntimeWarning, stacklevel=2)
        _done = True
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    finally:
        _lock.release()


class _CountingLoader:
    """Runs a transformers module with the original loader, tracking it for this thread; after the outermost one,
    registers once configuration_auto is complete. The module's spec gets its original loader back afterwards."""

    def __init__(self, loader, spec) -> None:
        self._loader, self._spec = loader, spec

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module) -> None:
        running, name = _running(), self._spec.name
        running.append(name)
        try:
            self._loader.exec_module(module)
        finally:
            running.pop()
            self._spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        # this module ran to its end, so it counts as complete although the import system has not marked it yet
        if not running and not _done and _TRIGGER in sys.modules and (name == _TRIGGER or not _initializing(_TRIGGER)):
            _register(name)


class _Finder:
    """Finds transformers modules with the finders after it and wraps their loaders in a _CountingLoader."""

    def find_spec(self, name: str, path=None, target=None):
        if not _watched(name):
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CountingLoader(spec.loader, spec)
                return spec
        return None


_FINDER = _Finder()


def install() -> None:
    """Register now if transformers' Auto configs are loaded, else once they are (idempotent; imports nothing of
    transformers)."""
    if _done:
        return
    if _TRIGGER in sys.modules and not _initializing(_TRIGGER):
        _register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
