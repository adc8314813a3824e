"""Enables vmm in every Python process of a program when VMM_TORCH_ENABLE asks for it.

Installed with the vmm_torch package beside a ``vmm_torch_autoenable.pth`` file, which Python
runs at every interpreter start (site-packages .pth files). Environment variables reach every
child process — ``torch.multiprocessing`` spawns, DataLoader workers, ``torchrun`` ranks — the
way ``PYTORCH_CUDA_ALLOC_CONF`` does, so one variable makes the whole program use vmm:

    VMM_TORCH_ENABLE=1 python train.py                 # default options
    VMM_TORCH_ENABLE=handle_type=posix_fd python train.py

With the variable unset (or "0") this module does nothing else and imports nothing beyond the
standard library. With it set, it waits for ``torch`` to be imported (a meta path hook, so
that interpreter start stays cheap and PyTorch's own import order is kept), then, before any
user code can touch CUDA or unpickle a tensor, calls ``vmm_torch.autoenable.run()``:
``vmm_torch.enable()`` with the variable's options (where this PyTorch can: a CUDA build, CUDA
not yet initialised) and ``vmm_torch.install_reducers()``. A failure is printed to stderr,
naming the variable; the program goes on with PyTorch's allocator.
"""

import os
import sys
import threading

VARIABLE = "VMM_TORCH_ENABLE"


def wanted() -> bool:
    """Whether VMM_TORCH_ENABLE asks for vmm (set, not empty, not "0"/"false"/"no"/"off")."""
    value = os.environ.get(VARIABLE, "").strip().lower()
    return bool(value) and value not in ("0", "false", "no", "off")


def _after_torch() -> None:
    try:
        import vmm_torch.autoenable

        vmm_torch.autoenable.run()
    except Exception as error:  # never break `import torch`
        sys.stderr.write(f"vmm_torch: {VARIABLE} is set but vmm could not be enabled: "
                         f"{type(error).__name__}: {error}\n")


class _TorchImportHook:
    """A meta path finder that finds nothing itself: asked for ``torch``, it lets the finders
    after it find it and wraps the loader's exec_module, so that _after_torch() runs once
    torch's module has executed. It stays in place until that happens: a mere lookup
    (``importlib.util.find_spec("torch")``, which libraries use to probe for torch) executes
    nothing, and the real import asks again."""

    def __init__(self):
        self._done = False
        self._looking = threading.local()  # a finder after this one may ask for torch again

    def find_spec(self, name, path=None, target=None):  # noqa: D401 (importlib protocol)
        if name != "torch" or self._done or getattr(self._looking, "active", False):
            return None
        spec = None
        self._looking.active = True
        try:
            for finder in list(sys.meta_path):
                if isinstance(finder, _TorchImportHook) or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self._looking.active = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module
        hook = self

        def exec_module(module):
            execute(module)
            if hook._done:
                return
            hook._done = True
            if hook in sys.meta_path:
                sys.meta_path.remove(hook)
            _after_torch()

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Arms the hook when VMM_TORCH_ENABLE asks for vmm (runs it at once if torch is already
    imported)."""
    if not wanted():
        return
    if "torch" in sys.modules:
        _after_torch()
    elif not any(isinstance(finder, _TorchImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())


install()
