"""``attn_implementation="fusedllm"`` after a plain ``import fusedllm``.

Importing transformers costs seconds, so ``import fusedllm`` does not do it.
Instead it calls :func:`install`: if transformers' modeling code
(``transformers.modeling_utils``, where ``AttentionInterface`` lives and where
every model's ``attn_implementation`` is checked) is already imported,
``fusedllm.hf`` is imported at once, which registers the backend; otherwise a
finder on ``sys.meta_path`` waits for that module and imports ``fusedllm.hf``
right after the module has executed, before any model can be built. The
finder looks at module names only, never imports anything itself, and
removes itself once it has fired.
"""

from __future__ import annotations

import sys
import warnings

TRIGGER = "transformers.modeling_utils"


def _register() -> None:
    try:
        import fusedllm.hf  # noqa: F401  (registers "fusedllm" on import)
    except Exception as exc:  # never break the user's import of transformers
        warnings.warn(f"fusedllm could not register attn_implementation='fusedllm' (and experts_implementation) with transformers "
                      f"({type(exc).__name__}: {exc}); `import fusedllm.hf` shows the full error",
                      RuntimeWarning, stacklevel=2)


def _module_ready(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _AfterImport:
    """Meta-path finder that runs :func:`_register` once TRIGGER has executed.

    It asks the finders after it for TRIGGER's spec and wraps that spec's
    loader's ``exec_module`` for this one load (the loader keeps its class,
    so nothing downstream sees a different loader)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER:
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module):
            try:
                exec_module(module)
            finally:
                try:
                    del loader.exec_module  # back to the class's method
                except AttributeError:
                    pass
            uninstall()
            _register()

        try:
            loader.exec_module = exec_then_register
        except AttributeError:  # a loader without instance attributes: leave it alone
            pass
        return spec


_FINDER = _AfterImport()


def install() -> None:
    """Register now if transformers' modeling code is loaded, else on its import."""
    if _module_ready(TRIGGER):
        _register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
