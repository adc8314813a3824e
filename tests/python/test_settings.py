"""vmm_torch._settings: allocator settings given at run time while vmm is PyTorch's CUDA
allocator (a backend item naming the allocator that was in place is left out; everything
else goes to PyTorch as given)."""

import pytest
import torch

from vmm_torch import _settings


@pytest.mark.parametrize("text, items", [
    ("", [""]),
    ("backend:native", ["backend:native"]),
    ("a:1,b:2", ["a:1", "b:2"]),
    ("a:1,,b:2", ["a:1", "", "b:2"]),
    ("roundup_power2_divisions:[256:1,512:2,>:1],backend:native",
     ["roundup_power2_divisions:[256:1,512:2,>:1]", "backend:native"]),
])
def test_items_split_at_commas_outside_brackets(text, items):
    assert _settings.split_items(text) == items


@pytest.mark.parametrize("environ, backend", [
    ({}, "native"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "native"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "cudaMallocAsync"),
    ({"PYTORCH_ALLOC_CONF": " back end : cudaMallocAsync ,max_split_size_mb:64"},
     "cudaMallocAsync"),
    # PYTORCH_ALLOC_CONF, set at all, is the one read (torch 2.9+).
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync",
      "PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "native"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTORCH_ALLOC_CONF": ""}, "native"),
])
def test_the_variables_name_the_startup_backend_as_pytorch_reads_them(environ, backend):
    assert _settings.startup_backend_from(environ) == backend


@pytest.mark.parametrize("text, left", [
    ("backend:native", ""),
    (" back end : native ", ""),
    ("backend:native,expandable_segments:False", "expandable_segments:False"),
    ("expandable_segments:False,backend:native", "expandable_segments:False"),
    ("roundup_power2_divisions:[256:1,512:2],backend:native",
     "roundup_power2_divisions:[256:1,512:2]"),
    # An empty item stays (PyTorch refuses it with either allocator).
    ("backend:native,,expandable_segments:True", ",expandable_segments:True"),
    # Unchanged: no such item, another backend (PyTorch refuses it with either allocator),
    # malformed text (PyTorch says what is wrong with it).
    ("expandable_segments:False", "expandable_segments:False"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync"),
    ("Backend:native", "Backend:native"),
    ("", ""),
    ("garbage", "garbage"),
    ("backend_x:native", "backend_x:native"),
])
def test_only_the_startup_backend_is_left_out(text, left):
    assert _settings.without_backend(text, "native") == left


def test_the_wrapper_passes_the_rest_and_returns_what_pytorch_returns():
    calls = []

    def setter(env):
        calls.append(env)
        return "result"

    wrapped = _settings.wrap(setter, "native")
    assert wrapped("backend:native") == "result"  # parsed as "": what a parse resets, resets
    assert wrapped("backend:native,garbage_collection_threshold:0.5") == "result"
    assert wrapped("backend:cudaMallocAsync") == "result"
    assert wrapped(None) == "result"  # not a string: PyTorch says what is wrong
    assert calls == ["", "garbage_collection_threshold:0.5", "backend:cudaMallocAsync", None]
    assert wrapped.__wrapped__ is setter and wrapped.__name__ == setter.__name__

    def failing(env):
        raise RuntimeError(f"refused {env}")

    with pytest.raises(RuntimeError, match="refused bogus:1"):
        _settings.wrap(failing, "native")("bogus:1,backend:native")


def test_install_wraps_torchs_setters_once_so_the_python_function_finds_them(monkeypatch):
    calls = []

    def setter(env):
        calls.append(env)

    for name in _settings.SETTERS:
        monkeypatch.setattr(torch._C, name, setter, raising=False)
    monkeypatch.setattr(_settings, "_installed", False)
    _settings.install("native")
    _settings.install("cudaMallocAsync")  # once: the first allocator is the one in place
    for name in _settings.SETTERS:
        assert getattr(torch._C, name).__wrapped__ is setter
        getattr(torch._C, name)("backend:native,expandable_segments:False")
    assert calls == ["expandable_segments:False"] * len(_settings.SETTERS)
    # What a program bound before enable() calls: torch.cuda.memory's function looks the
    # setter up in torch._C at each call (a stand-in of it here).
    def set_allocator_settings(env):
        return torch._C._accelerator_setAllocatorSettings(env)

    set_allocator_settings("backend:native")
    assert calls[-1] == ""


def test_install_leaves_a_torch_without_setters_alone(monkeypatch):
    for name in _settings.SETTERS:
        monkeypatch.delattr(torch._C, name, raising=False)
    monkeypatch.setattr(_settings, "_installed", False)
    _settings.install("native")
    assert all(not hasattr(torch._C, name) for name in _settings.SETTERS)


def test_the_startup_backend_is_the_allocator_in_place(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync",
                        raising=False)
    assert _settings.startup_backend() == "cudaMallocAsync"

    def unavailable():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", unavailable, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert _settings.startup_backend() == "cudaMallocAsync"
